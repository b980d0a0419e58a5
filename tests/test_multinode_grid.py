"""ParallelDims knows the nodes (zerompi/parallel/nodes.py): node index, node-local rank,
ranks per node, node-local and cross-node groups; an uneven layout is refused with one
message. On one host by ZEROMPI_RANKS_PER_NODE, and across simulated nodes for real."""
from __future__ import annotations

import json
import socket

from mpirun import WORKERS, launch, run_mpi, run_worker
from slurm_jobs import PY

FORCE = "ZEROMPI_RANKS_PER_NODE"


def _check_2x2(res: list[dict], names: list[str]) -> None:
    assert [x["rank"] for x in res] == [0, 1, 2, 3]
    for x in res:
        r = x["rank"]
        assert (x["index"], x["local_rank"], x["per_node"], x["count"]) == (r // 2, r % 2, 2, 2), x
        assert x["names"] == names, x
        assert x["node_members"] == [r // 2 * 2, r // 2 * 2 + 1], x
        assert x["cross_members"] == [r % 2, r % 2 + 2], x
        assert x["node_sum"] == sum(m + 1 for m in x["node_members"]), x
        assert x["cross_sum"] == sum(m + 1 for m in x["cross_members"]), x
        assert x["describe"] == "4 ranks on 2 nodes (2 per node" + (", " + FORCE if "#" in names[0] else "") + ")"
        assert x["name_23"] == f"ranks 2-3 (all of node {names[1]})", x


def test_forced_nodes_on_one_host(tmp_path):
    """ZEROMPI_RANKS_PER_NODE=2 at N = 4: two nodes of two consecutive ranks."""
    res = run_worker(4, "node_grid", [], tmp_path, env={FORCE: "2"})
    host = socket.gethostname()
    _check_2x2(res, [f"{host}#0", f"{host}#1"])


def test_one_host_is_one_node(tmp_path):
    res = run_worker(3, "node_grid", [], tmp_path)
    for x in res:
        assert (x["index"], x["local_rank"], x["per_node"], x["count"]) == (0, x["rank"], 3, 1), x
        assert x["names"] == [socket.gethostname()] and x["describe"] == "3 ranks on 1 node (3 per node)", x


def _one_uneven_line(out: str, nodes: str) -> None:
    lines = [ln for ln in out.splitlines() if "uneven layout" in ln]
    assert len(lines) == 1, out[-3000:]
    assert lines[0].startswith("zerompi.train: error: uneven layout: 3 ranks on 2 nodes with different "
                               f"numbers of ranks: {nodes}. zerompi needs the same number of ranks on every "
                               "node: srun --ntasks-per-node=P"), lines[0]
    assert "Traceback" not in out, out[-3000:]


def test_uneven_layout_is_refused_with_one_line(tmp_path):
    """3 ranks posing as nodes of 2: the train CLI ends with one line and exit 2."""
    host = socket.gethostname()
    r = run_mpi(3, ["-m", "zerompi.train", "--config", "configs/tiny.toml", "--run_dir", str(tmp_path / "run")],
                env={FORCE: "2"}, module=False, check=False, timeout=120)
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
    _check_2x2(json.loads(out.read_text()), net.nodes)

    uneven = net.mpiexec_argv(n=3, ppn=2)
    uneven[uneven.index("-hosts") + 1] = f"{net.nodes[0]}:2,{net.nodes[1]}:1"
    r = launch(uneven + [PY, "-m", "zerompi.train", "--config", "configs/tiny.toml",
                         "--run_dir", str(tmp_path / "run")], timeout=120)
    assert r.returncode == 2, r.stdout[-3000:]
    _one_uneven_line(r.stdout, f"{net.nodes[0]} (ranks 0-1), {net.nodes[1]} (rank 2)")
