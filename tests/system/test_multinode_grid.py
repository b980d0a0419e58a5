"""ParallelDims knows the nodes (zerompi/parallel/nodes.py): node index, node-local rank,
ranks per node, node-local and cross-node groups; an uneven layout is refused with one
message. Here: the train CLI refusing an uneven layout, and the grid across simulated
nodes for real; on one host by ZEROMPI_RANKS_PER_NODE: tests/multirank/test_node_grid.py."""
from __future__ import annotations

import json
import socket

from mpirun import WORKERS, launch, run_mpi, torch_unimportable
from node_grid_checks import check_2x2
from slurm_jobs import PY

FORCE = "ZEROMPI_RANKS_PER_NODE"


def _one_uneven_line(out: str, nodes: str) -> None:
    lines = [ln for ln in out.splitlines() if "uneven layout" in ln]
    assert len(lines) == 1, out[-3000:]
    assert lines[0].startswith("zerompi.train: error: uneven layout: 3 ranks on 2 nodes with different "
                               f"numbers of ranks: {nodes}. zerompi needs the same number of ranks on every "
                               "node: srun --ntasks-per-node=P"), lines[0]
    assert "Traceback" not in out, out[-3000:]


def test_uneven_layout_is_refused_with_one_line(tmp_path):
    """3 ranks posing as nodes of 2: the train CLI ends with one line and exit 2, before
    any rank imports torch."""
    host = socket.gethostname()
    r = run_mpi(3, ["-m", "zerompi.train", "--config", "configs/tiny.toml", "--run_dir", str(tmp_path / "run")],
                env={FORCE: "2", **torch_unimportable(tmp_path / "no-torch")}, module=False, check=False,
                timeout=120)
    assert r.returncode == 2, r.stdout[-3000:]
    _one_uneven_line(r.stdout, f"{host}#0 (ranks 0-1), {host}#1 (rank 2)")
    assert not (tmp_path / "run").exists()


def test_real_nodes(net_nodes, tmp_path):
    """Across simulated nodes MPI's shared-memory split finds them: the same grid, named
    by host; 3 ranks placed 2 + 1 are refused, naming both nodes."""
    net = net_nodes
    out = tmp_path / "grid.json"
    r = launch(net.mpiexec_argv(ppn=2) + [PY, str(WORKERS / "node_grid.py"), "--out", str(out)], timeout=120)
    assert r.returncode == 0, r.stdout[-3000:]
    check_2x2(json.loads(out.read_text()), net.nodes)

    uneven = net.mpiexec_argv(n=3, ppn=2)
    uneven[uneven.index("-hosts") + 1] = f"{net.nodes[0]}:2,{net.nodes[1]}:1"
    r = launch(uneven + [PY, "-m", "zerompi.train", "--config", "configs/tiny.toml",
                         "--run_dir", str(tmp_path / "run")], timeout=120)
    assert r.returncode == 2, r.stdout[-3000:]
    _one_uneven_line(r.stdout, f"{net.nodes[0]} (ranks 0-1), {net.nodes[1]} (rank 2)")
