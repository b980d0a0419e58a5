"""Shared by the benchmarks: paths, per-model shapes, the ranks' environment, machine and
software description, memory probes, small MPI/socket helpers.

Importing it puts this checkout's root on sys.path, so `import zerompi` in a benchmark finds
the package next to it, not an installed copy (an editable install may point at another
checkout).
Every benchmark imports its siblings by plain name (`from bench_env import ...`), which
works because a script's own folder is sys.path[0], also under `python -m mpi4py`.
"""
from __future__ import annotations

import json
import os
import platform
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


GiB = 1 << 30
# Per-rank micro-batch (sequences) and sequence length per model; identical for all systems.
DEFAULT_SHAPES = {"tiny": (2, 64), "small": (2, 128), "gpt-20m": (4, 256), "gpt-200m": (1, 256)}
MALLOC_ENVS = {
    "default": {},
    # glibc keeps freed large blocks in the heap once its dynamic mmap threshold has
    # grown; a fixed 128 KiB threshold returns them to the OS, so RSS follows frees.
    "mmap128k": {"MALLOC_MMAP_THRESHOLD_": "131072"},
}
# Environment for every rank: loopback only, one compute thread per rank.
RANK_ENV = {
    "GLOO_SOCKET_IFNAME": "lo", "UCX_NET_DEVICES": "lo",
    "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
}


def _jsonable(x):
    try:
        json.dumps(x)
        return x
    except TypeError:
        if isinstance(x, dict):
            return {str(k): _jsonable(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [_jsonable(v) for v in x]
        if hasattr(x, "__dict__"):
            return _jsonable(vars(x))
        return repr(x)


def current_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_process() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def vm_hwm() -> int | None:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return None


def reset_hwm() -> bool:
    """Reset the kernel's peak-RSS mark to the current RSS (Linux >= 4.0), so the
    training-steps peak excludes set-up transients such as the model's initial copy."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def mem_info() -> dict:
    out = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                k, v = line.split(":", 1)
                if k in ("MemTotal", "MemAvailable"):
                    out[k] = int(v.split()[0]) * 1024
    except OSError:
        pass
    return out


def machine_info() -> dict:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mi = mem_info()
    return {"node": platform.node(), "processor": platform.processor(), "cpu_model": cpu,
            "cores": os.cpu_count(), "ram_bytes": mi.get("MemTotal"),
            "platform": platform.platform(), "python": platform.python_version()}


def software_info() -> dict:
    import mpi4py
    import torch
    from mpi4py import MPI

    info = {"torch": torch.__version__, "mpi4py": mpi4py.__version__,
            "mpi_library": MPI.Get_library_version().strip().splitlines()[0],
            "mpi_library_full": MPI.Get_library_version().strip()}
    try:
        import zerompi
        info["zerompi"] = zerompi.__version__
    except Exception as e:  # the torch systems must still run if zerompi is broken
        info["zerompi"] = f"import failed: {e}"
    from importlib import metadata

    try:  # metadata only: importing deepspeed would start its accelerator probing
        info["deepspeed"] = metadata.version("deepspeed")
    except metadata.PackageNotFoundError:
        info["deepspeed"] = None
    try:  # read-only git plumbing: which code was measured
        info["git_commit"] = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"],
                                            capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "diff-index", "--quiet", "HEAD", "--"])
        info["git_dirty"] = dirty.returncode != 0
    except OSError:
        pass
    return info


def quiet_barrier(comm) -> None:
    """Barrier that sleeps while waiting: MPI_Barrier spins, and with more ranks than
    cores a spinning early rank would steal the core of a rank still computing."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(5e-5)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _nbytes(t) -> int:
    return t.numel() * t.element_size() if t is not None else 0

