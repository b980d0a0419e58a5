"""Training jobs across simulated nodes (tests/test_multinode_*.py): the config, the
site knobs of the "Ethernet / TCP" variant (slurm/README.md), launching zerompi.train
with mpiexec across nodes, and reading what a run left behind."""
from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import numpy as np

from mpirun import launch
from slurm_jobs import PY, REPO, _read
from test_slurm_templates import FAST_CONFIG

# The template tests' fast tiny run, one torch thread per rank (the simulated nodes
# declare 8 cores per task to Slurm; the VM has 2), and a data set read once.
CONFIG = FAST_CONFIG.replace('progress = "lines"', 'progress = "lines"\nthreads = 1')

# Only the environment changes between InfiniBand GPU nodes and these CPU nodes.
SITE_ENV = {"DEVICE": "cpu", "UCX_NET_DEVICES": "eth0", "UCX_TLS": "tcp,sm,self",
            "NCCL_SOCKET_IFNAME": "eth0", "SBATCH_GPUS_PER_NODE": "0", "PYTHON": PY,
            # MPICH's own launcher: srun --mpi=pmi2 hangs pip MPICH's MPI_Init across nodes
            # now and then (slurm/README.md, "Ethernet / TCP").
            "MPI_TYPE": "hydra"}


def write_config(path: Path, max_steps: int, stage: int = 2, top: str = "", zero: str = "") -> Path:
    """The config at `path`: max_steps, the ZeRO stage, extra TOML lines at the top
    level (`top`) and in [zero] (`zero`)."""
    text = CONFIG.format(max_steps=max_steps).replace("[zero]\nstage = 2\n", f"[zero]\nstage = {stage}\n{zero}")
    for line in top.splitlines():  # a key given here replaces the template's
        text = re.sub(rf"^{re.escape(line.split('=')[0].strip())} = .*\n", "", text, flags=re.M)
    text = top + text
    path.write_text(text)
    return path


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(ln) for ln in _read(run_dir / "metrics.jsonl").splitlines() if ln.strip()]


def wait_steps(run_dir: Path, n: int, alive, timeout: float = 120, why=lambda: "") -> None:
    """Until metrics.jsonl has n steps; fails if `alive()` turns false first."""
    t0 = time.monotonic()
    while len(metrics(run_dir)) < n:
        assert alive(), f"the job ended before step {n}: {metrics(run_dir)[-1:]}{why()}"
        assert time.monotonic() - t0 < timeout, f"fewer than {n} steps after {timeout} s{why()}"
        time.sleep(0.1)


def train_argv(cfg: Path, run_dir: Path, *extra: str) -> list[str]:
    return [PY, "-m", "zerompi.train", "--config", str(cfg), "--device", "cpu", "--run_dir", str(run_dir), *extra]


def train_mpiexec(net, cfg: Path, run_dir: Path, *extra: str, nodes=None, ppn: int = 2,
                  timeout: float = 180) -> subprocess.CompletedProcess:
    """zerompi.train across `nodes` (default all) of the NetCluster, ppn ranks each."""
    return launch(net.mpiexec_argv(ppn=ppn, nodes=nodes) + train_argv(cfg, run_dir, *extra), timeout=timeout)


def checkpoint_states(run_dir: Path, tag: str | None = None) -> dict[str, np.ndarray]:
    """Every saved state (fp32 master and both moments) of the run's latest (or `tag`)
    checkpoint, as full flat arrays keyed 'kind/name'."""
    from zerompi.checkpoint import read_manifest, resolve
    from zerompi.checkpoint.reader import PieceReader

    ckpt = resolve(str(run_dir / "checkpoints"), tag)
    m = read_manifest(ckpt)
    reader = PieceReader(ckpt, m)
    out = {}
    for name, t in m["tensors"].items():
        n = int(np.prod(t["shape"])) if t["shape"] else 1
        for kind in m["kinds"]:
            out[f"{kind}/{name}"] = reader.read(kind, name, 0, n)
    return out


def same_states(a: dict, b: dict) -> list[str]:
    """Keys whose arrays differ in any bit (or exist on one side only)."""
    return sorted(k for k in a.keys() | b.keys()
                  if k not in a or k not in b or a[k].tobytes() != b[k].tobytes())


__all__ = ["CONFIG", "SITE_ENV", "REPO", "write_config", "metrics", "wait_steps", "train_argv",
           "train_mpiexec", "checkpoint_states", "same_states"]
