"""Guards around MPI start-up: a deadline on MPI_Init, and a launch that gave every
process a world of its own.

MPI_Init runs inside `import mpi4py.MPI`, in C, holding the GIL: while it waits for a
process manager that never answers (a PMI mismatch, a wedged `srun --mpi=pmi2` across
nodes), no Python thread or signal handler of this process runs, and the job waits for
its time limit. So the deadline is kept by a second process, forked just before the
import: a watcher that only waits on a pipe (forked, not a new interpreter, whose start
every rank of every job would pay). The rank writes one byte once MPI is up and the watcher
exits; if the pipe stays silent past the deadline, the watcher prints one line (the
launcher and MPI it saw, what to try) and SIGKILLs the rank. A rank that dies first
closes the pipe, which also ends the watcher.

Deadline: $ZEROMPI_STARTUP_TIMEOUT_S (the launch's word, known before any config is
read), else `zero.comm.startup_timeout_s` of the config when the caller knows it (the
train command reads that key before MPI starts; zerompi.initialize loads the config first),
else that key's default. 0 = no guard.

After MPI_Init: when the launcher says the job has N > 1 tasks (Slurm's step, PMI,
Open MPI) and MPI gives a world of 1, the launcher and the MPI library do not speak the
same PMI (`srun --mpi=none`, another MPI's mpiexec first on PATH): every process would
train alone. runtime.init ends that with one line instead (abort.LaunchMismatch).
"""
from __future__ import annotations

import os
import select
import signal
import sys
import time
import warnings

ENV_TIMEOUT = "ZEROMPI_STARTUP_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 1200.0    # = CommConfig.startup_timeout_s (tests/unit/test_startup.py checks)
QUIET_GRACE_S = 5.0           # ranks other than the launcher's 0 wait this long before they speak

# What the launcher tells each process about the job's size (the first one set wins).
SIZE_VARS = ("SLURM_STEP_NUM_TASKS", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE")
RANK_VARS = ("SLURM_PROCID", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")
SEEN_VARS = ("SLURM_MPI_TYPE", "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_STEP_NUM_NODES", "PMI_SIZE",
             "PMI_RANK", "PMI_FD", "PMI_PORT", "PMIX_RANK", "PMIX_NAMESPACE", "OMPI_COMM_WORLD_SIZE",
             "MPI4PY_LIBMPI", "I_MPI_PMI_LIBRARY")


def env_rank(env=os.environ) -> int | None:
    """This process's rank as the launcher numbered it (None: no launcher said)."""
    for k in RANK_VARS:
        if env.get(k, "").strip().isdigit():
            return int(env[k])
    return None


def env_size(env=os.environ) -> tuple[str, int] | None:
    """(variable, tasks) the launcher gave this job, or None."""
    for k in SIZE_VARS:
        v = env.get(k, "").strip()
        if v.isdigit():
            return k, int(v)
    return None


def timeout_s(config_value: float | None = None) -> float:
    """The deadline on MPI_Init (module docstring); ValueError naming the variable."""
    raw = os.environ.get(ENV_TIMEOUT, "").strip()
    if raw:
        try:
            t = float(raw)
        except ValueError:
            t = -1.0
        if not t >= 0:
            raise ValueError(f"{ENV_TIMEOUT}={raw!r}: must be a number of seconds >= 0 (0 = no deadline)")
        return t
    return DEFAULT_TIMEOUT_S if config_value is None else float(config_value)


def launcher(env=os.environ) -> str:
    """The launcher, as the environment shows it."""
    if env.get("SLURM_STEP_ID") is not None or env.get("SLURM_STEP_NUM_TASKS") is not None:
        mpi = env.get("SLURM_MPI_TYPE")  # unset under --mpi=none, which sets no PMI variables either
        if mpi:
            return f"srun --mpi={mpi}"
        if not any(k.startswith(("PMI_", "PMIX_")) for k in env):
            return "srun --mpi=none (no PMI or PMIx variables)"
        return "srun (SLURM_MPI_TYPE unset)"
    if env.get("OMPI_COMM_WORLD_SIZE") is not None:
        return "Open MPI's mpirun"
    if env.get("PMIX_RANK") is not None:
        return "a PMIx launcher"
    if env.get("PMI_RANK") is not None or env.get("PMI_FD") is not None or env.get("PMI_PORT") is not None:
        return "a PMI-1 launcher (mpiexec/hydra)"
    return "no launcher (a single process)"


def mpi_library(pid: int | None = None, env=os.environ) -> str:
    """The MPI library process `pid` has loaded (its memory map), else the one mpi4py is
    told to load, else mpi4py's own choice."""
    try:
        with open(f"/proc/{pid or os.getpid()}/maps") as f:
            libs = [ln.split()[-1] for ln in f if "/libmpi" in ln or "/libmpich" in ln]
        if libs:
            return libs[0]
    except OSError:
        pass
    return env.get("MPI4PY_LIBMPI") or "not loaded yet (mpi4py's default: the libmpi on its search path)"


def stall_line(seconds: float, pid: int | None = None, env=os.environ) -> str:
    """The one line of a start-up that passed its deadline."""
    seen = ", ".join(f"{k}={env[k]}" for k in SEEN_VARS if env.get(k)) or "no PMI or Slurm variables"
    where = launcher(env)
    if where.startswith("srun"):
        hint = ("with pip's MPICH launch with mpiexec (hydra) inside the allocation, or srun --mpi=pmi2 "
                "--kill-on-bad-exit=1; a site MPI built with PMIx: srun --mpi=pmix")
    else:
        hint = "use the mpiexec of the MPI library above (`which mpiexec`), the same on every node"
    return (f"zerompi: error: MPI did not start within {seconds:g} s ({ENV_TIMEOUT} or "
            f"zero.comm.startup_timeout_s): launcher {where} ({seen}); MPI library {mpi_library(pid, env)}. "
            f"Try: {hint}; check that the nodes reach each other (UCX_NET_DEVICES); "
            f"a very large job may need a longer {ENV_TIMEOUT}")


class Guard:
    """A watcher process that ends this one if `done()` is not called within `seconds`."""

    def __init__(self, seconds: float):
        r, w = os.pipe()
        parent = os.getpid()
        with warnings.catch_warnings():  # 3.12 warns of fork in a threaded process (the watchdog's
            warnings.simplefilter("ignore", DeprecationWarning)  # thread): the child takes no lock
            pid = os.fork()
        if pid == 0:
            try:
                os.close(w)
                _as_watcher()
                _watch(r, parent, seconds)
            finally:
                os._exit(0)
        os.close(r)
        self._w, self._pid = w, pid

    def done(self) -> None:
        try:
            os.write(self._w, b"x")
        except OSError:  # the watcher is gone (a Ctrl-C reached the process group)
            pass
        os.close(self._w)
        os.waitpid(self._pid, 0)  # it exits as soon as it reads the byte


def _as_watcher() -> None:
    """The rank's signal handlers and wake-up fd are not the watcher's: the default
    disposition (a TERM from the launcher ends it) and nothing written to the rank's fd."""
    try:
        signal.set_wakeup_fd(-1)
        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP):
            signal.signal(s, signal.SIG_DFL)
    except (ValueError, OSError):
        pass


def import_mpi(seconds: float | None = None):
    """mpi4py.MPI, initialising MPI under the start-up deadline the first time."""
    MPI = sys.modules.get("mpi4py.MPI")
    if MPI is not None:
        return MPI
    t = timeout_s(seconds)
    guard = Guard(t) if t > 0 else None
    try:
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            from mpi4py import MPI
    finally:
        if guard is not None:
            guard.done()
    for w in said:  # mpi4py's own "suspicious MPI execution environment": runtime.init's line says more
        if mismatch(MPI.COMM_WORLD.Get_size()) is None or "suspicious MPI" not in str(w.message):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return MPI


def mismatch(world_size: int, env=os.environ) -> str | None:
    """The line for a world of 1 inside a launch of N > 1 tasks, or None."""
    said = env_size(env)
    if world_size != 1 or said is None or said[1] <= 1:
        return None
    var, n = said
    return (f"the launcher started {n} tasks ({var}={n}, launcher {launcher(env)}) but MPI gave each a "
            f"world of 1 rank (MPI library {mpi_library(None, env)}): the launcher and the MPI library do not "
            "speak the same process-management interface. Use srun --mpi=pmi2 for pip's MPICH (--mpi=pmix "
            "for a PMIx build), or the mpiexec of the MPI library above; --mpi=none never works")


def _watch(fd: int, pid: int, seconds: float) -> None:
    """The watcher's body: silent exit when the pipe speaks or closes in time."""
    if select.select([fd], [], [], seconds)[0]:
        return
    if env_rank() not in (None, 0):  # the launcher's rank 0 speaks for the job; the others
        if select.select([fd], [], [], QUIET_GRACE_S)[0]:  # only when still stuck after it
            return
    line = stall_line(seconds, pid)
    try:
        os.write(2, (line + "\n").encode("utf-8", "replace"))
    except OSError:
        pass
    time.sleep(0.2)  # the launcher reads the line before it sees the rank die
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass
