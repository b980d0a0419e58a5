"""What every benchmark shares: starting jobs, waiting for a quiet machine, the record of
machine, software and code, partial-JSON writes, plot helpers, memory probes. Importing it
puts this checkout's root first on sys.path (`import zerompi` finds the package next to it);
benchmarks import it and each other by plain name (a script's folder is sys.path[0])."""
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
RESULTS = HERE / "results"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from zerompi.runtime import jobs  # noqa: E402

GiB = 1 << 30
# Per-rank micro-batch (sequences) and sequence length per model; identical for all systems.
DEFAULT_SHAPES = {"tiny": (2, 64), "small": (2, 128), "gpt-20m": (4, 256), "gpt-200m": (1, 256)}
RANK_ENV = jobs.LOCAL_ENV
# A segment another job created a moment ago may not be mapped yet: only older ones go.
SHM_MIN_AGE_S = 2.0


# ------------------------------------------------------------------ jobs
def launch(nranks: int | None, argv, *, timeout: float, env: dict | None = None, root: str | Path = ROOT,
           python: str = sys.executable, log: str | Path | None = None, echo: bool = False,
           mpiexec: list[str] | None = None) -> jobs.Job:
    """`[mpiexec -n N] PYTHON -m mpi4py ARGV` through zerompi/runtime/jobs.py (the tests'
    launcher) to its end or timeout; on timeout or interrupt the whole job is killed and its
    dead MPICH segments removed. The ranks get the caller's environment without glibc
    allocator variables (a stray one changes RSS and step times unnoticed; pass one in
    `env`), loopback networking, one thread each, PYTHONPATH starting with `root`. `log`
    gets the output, `echo` prints it; `mpiexec`: another launcher (simulated nodes')."""
    cmd = jobs.mpi_command(nranks, argv, python)
    if mpiexec:
        cmd = [*mpiexec, *cmd]
    dropped = sorted(k for k in os.environ if jobs.allocator_var(k) and k not in (env or {}))
    if dropped:
        print(f"[launch] not passed to the ranks: {', '.join(dropped)}", flush=True)
    return jobs.run(cmd, timeout=timeout, env=jobs.local_env(root, env, cmd, drop_allocator=True), log=log,
                    echo=echo, shm_min_age_s=SHM_MIN_AGE_S)


def cpu_busy() -> float:
    """Busy CPU seconds of the whole machine since boot (/proc/stat, all cores)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")  # minus idle and iowait


def wait_quiet(max_busy: float, max_wait: float) -> dict:
    """Wait (up to max_wait s) until the machine's busy fraction over 3 s is at most
    max_busy (>= 1: no wait): other processes on the cores change the timings."""
    t0, cores = time.time(), os.cpu_count() or 1
    if max_busy >= 1:
        return {}
    while True:
        b0 = cpu_busy()
        time.sleep(3.0)
        busy = (cpu_busy() - b0) / (3.0 * cores)
        if busy <= max_busy or time.time() - t0 > max_wait:
            return {"busy_fraction_before": busy, "waited_s": time.time() - t0}
        print(f"  machine busy ({100 * busy:.0f}% of {cores} cores), waiting ...", flush=True)


class ForeignCpu:
    """How much of the machine other processes used while a block ran:
    `with ForeignCpu() as f: ...; f.fraction`."""

    @staticmethod
    def children() -> float:
        r = resource.getrusage(resource.RUSAGE_CHILDREN)
        return r.ru_utime + r.ru_stime

    def __enter__(self):
        self.t0, self.b0, self.c0 = time.time(), cpu_busy(), self.children()
        return self

    def __exit__(self, *exc):
        self.wall = time.time() - self.t0
        own, busy = self.children() - self.c0, cpu_busy() - self.b0
        self.fraction = max(0.0, busy - own) / (max(self.wall, 1e-9) * (os.cpu_count() or 1))


# ------------------------------------------------------------------ the record
def mem_info() -> dict:
    try:
        with open("/proc/meminfo") as f:
            rows = [line.split(":", 1) for line in f]
    except OSError:
        return {}
    return {k: int(v.split()[0]) * 1024 for k, v in rows if k in ("MemTotal", "MemAvailable")}


def machine_info(directory: str | None = None) -> dict:
    """The machine; with `directory`, also the file system it lies on."""
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    out = {"node": platform.node(), "processor": platform.processor(), "cpu_model": cpu,
           "cores": os.cpu_count(), "ram_bytes": mem_info().get("MemTotal"),
           "platform": platform.platform(), "python": platform.python_version()}
    if directory:
        try:
            df = subprocess.run(["df", "-T", directory], capture_output=True, text=True).stdout.splitlines()[-1]
            out["disk"] = "{} ({})".format(*df.split()[:2])
        except (OSError, IndexError):
            out["disk"] = "?"
    return out


def git_info(root: str | Path = ROOT) -> dict:
    """Which code was measured: read-only git plumbing."""
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True)
        dirty = subprocess.run(["git", "-C", str(root), "diff-index", "--quiet", "HEAD", "--"],
                               capture_output=True)
    except OSError:
        return {}
    return {"git_commit": head.stdout.strip(), "git_dirty": dirty.returncode != 0}


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
    return {**info, **git_info()}


def record(software: bool = True, directory: str | None = None) -> dict:
    """The head of every results file: when, on what, with which code."""
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": machine_info(directory),
            **({"software": software_info()} if software else {"code": git_info()}),
            "loadavg_start": os.getloadavg()}


def machine_name() -> str:
    """How results name this machine: $ZEROMPI_BENCH_MACHINE, else the host name."""
    return os.environ.get("ZEROMPI_BENCH_MACHINE") or platform.node() or "host"


def result_path(what: str) -> Path:
    """results/<what>_<machine>_<yyyymm>.json"""
    return RESULTS / f"{what}_{machine_name()}_{time.strftime('%Y%m')}.json"


def write_json(path: str | Path, obj) -> None:
    """Write results as they come: after each run, atomically (a cut-off benchmark keeps
    what finished, never half a file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(jsonable(obj), indent=1))
    os.replace(tmp, path)


def pyplot():
    """matplotlib's pyplot, drawing to files only."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, png: str | Path, title: str | None = None) -> None:
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    pyplot().close(fig)


def machine_title(machine: dict) -> str:
    return f"{machine.get('cpu_model', '?')}, {machine.get('cores', '?')} cores"


# ------------------------------------------------------------------ inside the ranks
def jsonable(x):
    """x with what JSON cannot hold turned into dicts, lists or repr()."""
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if x is None or isinstance(x, (str, int, float, bool)):
        return x
    return jsonable(vars(x)) if hasattr(x, "__dict__") else repr(x)


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


def nbytes(t) -> int:
    return t.numel() * t.element_size() if t is not None else 0
