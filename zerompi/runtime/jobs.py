"""Run a job on this machine and end it cleanly: one command line, one environment, one
kill policy, one /dev/shm cleaner. The test suite (tests/support/mpirun.py) and the
benchmarks (benchmarks/harness.py) start every job through `run` or `start`.

    job = run(mpi_command(2, ["train_worker.py", "--steps", "3"]), timeout=300, env=local_env())
    if not job.ok: print(job.status, job.tail())

Kill policy: the job runs in a session of its own. On timeout, or when the caller gets
SIGINT, SIGTERM or SIGHUP, the job's process group and every process descended from it
get SIGKILL: MPICH's proxy and ranks run in sessions of their own, so the group alone
would miss them; the descendants are listed before anything is killed, and only
processes this job started are signalled. When the caller dies without a word (SIGKILL),
mpiexec gets SIGTERM from the kernel (PR_SET_PDEATHSIG) and ends its ranks itself.
A timeout returns a Job with timed_out set; an interrupt kills the job, then re-raises.

MPICH leaves its shared-memory segments in /dev/shm when a job is killed or aborted; the
ones that appeared during the job and that no live process maps are removed afterwards,
so repeated jobs do not fill /dev/shm, while another job's segments stay.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from .rundir import clean_dead_shm

SHM = Path("/dev/shm")
# One machine: traffic on loopback, one compute thread per rank, unbuffered output.
LOCAL_ENV = {"UCX_NET_DEVICES": "lo", "NCCL_SOCKET_IFNAME": "lo", "GLOO_SOCKET_IFNAME": "lo",
             "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
# MPICH polls while a rank waits: with more ranks than cores the pollers hold the cores the
# working rank needs. These make them give the core up (nanosleep when yielding MPICH's
# lock, usleep after polls that made no progress).
YIELD_WHEN_OVERSUBSCRIBED = {"MPIR_CVAR_ENABLE_HEAVY_YIELD": "1", "MPIR_CVAR_CH4_PROGRESS_THROTTLE": "1"}


@dataclass
class Job:
    command: list[str]
    returncode: int
    timed_out: bool
    elapsed_s: float
    output: str                 # stdout, with stderr merged in unless kept apart
    stderr: str | None = None   # when kept apart
    ended: float = field(default_factory=time.time)  # wall clock, to compare with times a rank printed

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out

    @property
    def status(self) -> int | str:
        """What results files record: the exit code, or "timeout"."""
        return "timeout" if self.timed_out else self.returncode

    @property
    def command_line(self) -> str:
        return " ".join(shlex.quote(c) for c in self.command)

    def tail(self, chars: int = 3000) -> str:
        return self.output[-chars:]


def mpi_command(nranks: int | None, argv, python: str = sys.executable, module: bool = True) -> list[str]:
    """`mpiexec -n N PYTHON -m mpi4py ARGV` (N = None: one process, no mpiexec). Under
    mpi4py an uncaught exception on one rank aborts the whole job instead of leaving its
    peers waiting. ARGV is a script and its arguments, or `-m module ...`."""
    cmd = [python, *(["-m", "mpi4py"] if module else []), *map(str, argv)]
    return cmd if nranks is None else ["mpiexec", "-n", str(nranks), *cmd]


def ranks_of(cmd: list[str] | None) -> int:
    """Processes an `mpiexec -n A ... [: -n B ...]` command starts (0 for other commands)."""
    if not cmd or os.path.basename(str(cmd[0])) != "mpiexec":
        return 0
    return sum(int(cmd[i + 1]) for i, a in enumerate(cmd[:-1]) if a in ("-n", "-np") and str(cmd[i + 1]).isdigit())


def allocator_var(name: str) -> bool:
    """glibc allocator settings, which change RSS and step times unnoticed."""
    return name == "GLIBC_TUNABLES" or (name.startswith("MALLOC_") and name.endswith("_"))


def local_env(root: str | Path | None = None, extra: dict | None = None, cmd: list[str] | None = None,
              drop_allocator: bool = False) -> dict:
    """The caller's environment for a job on this machine: LOCAL_ENV; PYTHONPATH starting
    with `root` (the checkout whose zerompi the ranks must import); the oversubscription
    settings when `cmd` starts more ranks than this process may use cores; without glibc
    allocator variables if `drop_allocator`; then `extra` (a value of None removes it)."""
    env = {k: v for k, v in os.environ.items() if not (drop_allocator and allocator_var(k))}
    env.update(LOCAL_ENV)
    if root is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p)
    if ranks_of(cmd) > len(os.sched_getaffinity(0)):
        env.update(YIELD_WHEN_OVERSUBSCRIBED)
    for k, v in (extra or {}).items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = str(v)
    return env


def start(cmd: list[str], env: dict | None = None, stderr_apart: bool = False, stdout=subprocess.PIPE,
          **popen) -> subprocess.Popen:
    """Start CMD in a session of its own, ended by SIGTERM if the caller dies; text output
    to a pipe (or `stdout`, a file), stderr merged into it unless kept apart."""
    return subprocess.Popen(cmd, stdout=stdout, stderr=subprocess.PIPE if stderr_apart else subprocess.STDOUT,
                            text=True, errors="replace", env=env, start_new_session=True,
                            preexec_fn=_term_with_parent, **popen)


def run(cmd: list[str], *, timeout: float, env: dict | None = None, stderr_apart: bool = False,
        log: str | Path | None = None, echo: bool = False, shm_min_age_s: float = 0.0, **popen) -> Job:
    """Run CMD to its end or its timeout (seconds, required). `log` gets its output, `echo`
    prints it line by line as it comes. `shm_min_age_s`: remove only segments at least
    this old (waiting for this job's youngest to reach it), for callers beside which
    other jobs start that may not have mapped their fresh segment yet."""
    if not timeout or timeout <= 0:
        raise ValueError("every job needs a timeout > 0 seconds")
    shm_before = shm_segments()
    out: list[str] = []
    err: list[str] = []
    t0 = time.monotonic()
    p = start(cmd, env, stderr_apart, **popen)
    readers = [threading.Thread(target=_read, args=(s, lines, echo), daemon=True)
               for s, lines in ((p.stdout, out), (p.stderr, err)) if s is not None]
    for r in readers:
        r.start()
    timed_out = False
    try:
        with _signals_interrupt():
            try:
                p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
                kill_job(p)
    except BaseException:  # KeyboardInterrupt from SIGINT, SIGTERM or SIGHUP
        kill_job(p)
        raise
    finally:
        p.wait()
        elapsed = time.monotonic() - t0
        for r in readers:
            r.join(timeout=10)  # a descendant outside the snapshot may still hold the pipe
        clean_shm(shm_segments() - shm_before, shm_min_age_s)
    job = Job(list(map(str, cmd)), p.returncode, timed_out, elapsed, "".join(out),
              "".join(err) if stderr_apart else None)
    if log:
        Path(log).write_text(job.output)
    return job


try:   # looked up here, not in the forked child (no dlopen between fork and exec)
    _PRCTL = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):   # not Linux: the interrupt handlers still cover SIGINT/TERM/HUP
    _PRCTL = None


def _term_with_parent() -> None:
    """In the child, before exec: SIGTERM when the caller dies (even by SIGKILL). The
    signal fires when the thread that started the job ends; run() waits in that thread."""
    if _PRCTL is not None:
        _PRCTL(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG


def _read(stream, lines: list[str], echo: bool) -> None:
    for line in stream:
        lines.append(line)
        if echo:
            sys.stdout.write(line)
            sys.stdout.flush()


def descendants(pid: int) -> list[int]:
    """Live processes descended from pid, from /proc's parent links."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def kill_job(p: subprocess.Popen) -> None:
    """SIGKILL a job started here: its process group, then each descendant."""
    if p.poll() is not None:
        return
    victims = descendants(p.pid)  # before the kill: orphans lose their parent link
    for kill, target in [(os.killpg, p.pid)] + [(os.kill, v) for v in victims]:
        try:
            kill(target, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


@contextlib.contextmanager
def _signals_interrupt():
    """While a job runs, SIGTERM and SIGHUP raise KeyboardInterrupt as SIGINT does, so the
    job is killed instead of orphaned (handlers can be set in the main thread only)."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")

    saved = {}
    if threading.current_thread() is threading.main_thread():
        saved = {s: signal.signal(s, interrupt) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in saved.items():
            signal.signal(s, h)


def shm_segments() -> set[str]:
    try:
        return {p.name for p in SHM.glob("mpich_shm_*")}
    except OSError:
        return set()


def clean_shm(names: set[str], min_age_s: float = 0.0) -> list[str]:
    """Remove these MPICH segments where no live process maps them; with min_age_s, first
    wait until the youngest is that old (one just created may not be mapped yet)."""
    if not names:
        return []
    if min_age_s > 0:
        ages = []
        for name in names:
            with contextlib.suppress(OSError):  # already unlinked
                ages.append(time.time() - (SHM / name).stat().st_mtime)
        if not ages:
            return []
        time.sleep(max(0.0, min_age_s - min(ages)))
    return clean_dead_shm(str(SHM), min_age_s=min_age_s, only=names)
