"""How every benchmark starts a job: one command line, one environment, one kill policy.

    job = launch(2, [HERE / "bench_dp.py", "--system", "zerompi-3", ...], timeout=900)
    if not job.ok: print(job.status, job.tail())

The command is `mpiexec -n N PYTHON -m mpi4py ARGV` (N = None: one process, no mpiexec);
under mpi4py an uncaught exception on one rank aborts the whole job instead of leaving
its peers waiting. ARGV is a script and its arguments, or `-m module ...`.

The ranks get the caller's environment with these changes:
- glibc allocator variables (MALLOC_*_, GLIBC_TUNABLES) are dropped, so a stray one in
  the caller's shell cannot change RSS and step times unnoticed; a benchmark that wants
  one passes it in `env` (bench_dp's --malloc does);
- bench_env.RANK_ENV: loopback only, one compute thread per rank, unbuffered output;
- PYTHONPATH starts with `root`, the checkout whose zerompi the ranks must import (this
  one by default; compare_commits passes each side's);
- then `env` (a value of None removes that variable).

Kill policy: the job runs in a session of its own. On timeout, or when the driver gets
SIGINT, SIGTERM or SIGHUP, mpiexec's process group and every process descended from it
get SIGKILL; when the driver dies without a word (SIGKILL), mpiexec gets SIGTERM from the
kernel (PR_SET_PDEATHSIG) and ends the ranks itself. MPICH's proxy and each rank run in
sessions of their own, so the group alone would miss them; the descendants are listed
before anything is killed, and only processes this launch started are ever signalled.
A timeout returns a Job with timed_out set; an interrupt kills the job and then raises
KeyboardInterrupt in the driver, which can still write the results it has. MPICH's shared-memory segments that
appeared during the job and that no live process maps any more are removed afterwards,
once 2 s old (a killed or aborted job leaves them in /dev/shm; a younger one may belong to
another job that has not mapped it yet).
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
from dataclasses import dataclass
from pathlib import Path

from bench_env import RANK_ENV, ROOT

SHM = Path("/dev/shm")
SHM_MIN_AGE_S = 2.0


@dataclass
class Job:
    command: list[str]
    returncode: int
    timed_out: bool
    elapsed_s: float
    output: str  # stdout and stderr, merged

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


def command(nranks: int | None, argv, python: str = sys.executable) -> list[str]:
    cmd = [python, "-m", "mpi4py", *map(str, argv)]
    return cmd if nranks is None else ["mpiexec", "-n", str(nranks), *cmd]


def _allocator_var(name: str) -> bool:
    return name == "GLIBC_TUNABLES" or (name.startswith("MALLOC_") and name.endswith("_"))


def rank_env(root: str | Path = ROOT, env: dict | None = None) -> dict:
    """The ranks' environment (see the module docstring)."""
    out = {k: v for k, v in os.environ.items() if not _allocator_var(k)}
    out.update(RANK_ENV)
    out["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p)
    for k, v in (env or {}).items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = str(v)
    return out


def launch(nranks: int | None, argv, *, timeout: float, env: dict | None = None,
           root: str | Path = ROOT, python: str = sys.executable, log: str | Path | None = None,
           echo: bool = False) -> Job:
    """Run one job to its end or its timeout (seconds, required); `log` gets its output,
    `echo` prints it line by line as it comes."""
    if not timeout or timeout <= 0:
        raise ValueError("every job needs a timeout > 0 seconds")
    cmd = command(nranks, argv, python)
    dropped = sorted(k for k in os.environ if _allocator_var(k) and k not in (env or {}))
    if dropped:
        print(f"[launch] not passed to the ranks: {', '.join(dropped)}", flush=True)
    shm_before = _shm_segments()
    lines: list[str] = []
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         errors="replace", env=rank_env(root, env), start_new_session=True,
                         preexec_fn=_term_with_parent)
    reader = threading.Thread(target=_read, args=(p.stdout, lines, echo), daemon=True)
    reader.start()
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
        reader.join(timeout=10)  # a descendant outside the snapshot may still hold the pipe
        _clean_shm(_shm_segments() - shm_before)
    job = Job(cmd, p.returncode, timed_out, elapsed, "".join(lines))
    if log:
        Path(log).write_text(job.output)
    return job


try:   # looked up here, not in the forked child (no dlopen between fork and exec)
    _PRCTL = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):   # not Linux: the interrupt handlers still cover SIGINT/TERM/HUP
    _PRCTL = None


def _term_with_parent() -> None:
    """In the child, before exec: SIGTERM when the driver dies (even by SIGKILL, which no
    handler sees). mpiexec passes SIGTERM on to the ranks and ends, so a killed driver
    leaves no job behind; the signal fires when the thread that started the job ends,
    and launch() waits in that thread."""
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
    """SIGKILL a job this module started: its process group, then each descendant."""
    if p.poll() is not None:
        return
    victims = descendants(p.pid)  # before the kill: orphans lose their parent link
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for pid in victims:
        try:
            os.kill(pid, signal.SIGKILL)
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


def _shm_segments() -> set[str]:
    try:
        return {p.name for p in SHM.glob("mpich_shm_*")}
    except OSError:
        return set()


def _clean_shm(new: set[str]) -> None:
    if not new:
        return
    try:
        from zerompi.runtime.rundir import clean_dead_shm
    except Exception as e:  # a checkout mid-change must not turn a finished job into a failure
        print(f"[launch] left {len(new)} MPICH segment(s) in {SHM}: {e}", flush=True)
        return
    # A segment another job created a moment ago may not be mapped yet: only segments at
    # least SHM_MIN_AGE_S old go, so wait for this job's youngest to reach that age.
    ages = []
    for name in new:
        try:
            ages.append(time.time() - (SHM / name).stat().st_mtime)
        except OSError:
            pass  # already unlinked
    if ages:
        time.sleep(max(0.0, SHM_MIN_AGE_S - min(ages)))
        clean_dead_shm(str(SHM), min_age_s=SHM_MIN_AGE_S, only=new)
