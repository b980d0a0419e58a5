"""Run a worker script on N MPI ranks from a single-process pytest.

A rank that fails makes mpiexec exit non-zero (the worker runs under `python -m mpi4py`
or zerompi's abort hook); a deadlock becomes a timeout, after which the whole process
group is killed, so one broken test never hangs the suite.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent          # the checkout every rank imports zerompi from
WORKERS = TESTS / "workers"
DATA = TESTS / "data"



def gone(pid: int) -> bool:
    """The process has ended: no such pid, or a zombie (exited; its parent, or a PID 1
    that never reaps, has not collected it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True

# MPICH polls while a rank waits. With more ranks than cores (3-4 ranks on the 2-core CI
# machine) the pollers hold the cores the working rank needs: give them up instead
# (nanosleep when yielding MPICH's lock, usleep after polls that made no progress).
# Measured on 4 ranks here: 25-30% less CPU time for the same cases.
YIELD_WHEN_OVERSUBSCRIBED = {"MPIR_CVAR_ENABLE_HEAVY_YIELD": "1", "MPIR_CVAR_CH4_PROGRESS_THROTTLE": "1"}


def ranks_of(cmd: list[str] | None) -> int:
    """Processes an `mpiexec -n A ... [: -n B ...]` command starts (0 for other commands)."""
    if not cmd or os.path.basename(str(cmd[0])) != "mpiexec":
        return 0
    return sum(int(cmd[i + 1]) for i, a in enumerate(cmd[:-1]) if a in ("-n", "-np") and str(cmd[i + 1]).isdigit())


def mpi_env(extra: dict | None = None, cmd: list[str] | None = None) -> dict:
    """The test environment of a job (of `cmd`, if it is an mpiexec command)."""
    env = dict(os.environ)
    env.update({
        "UCX_NET_DEVICES": "lo", "NCCL_SOCKET_IFNAME": "lo",  # keep traffic on loopback
        "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    })
    if ranks_of(cmd) > len(os.sched_getaffinity(0)):
        env.update(YIELD_WHEN_OVERSUBSCRIBED)
    env.update(extra or {})
    return env


SHM = Path("/dev/shm")


def _shm_segments() -> set[str]:
    try:
        return {p.name for p in SHM.glob("mpich_shm_*")}
    except OSError:
        return set()


def torch_unimportable(tmp: Path) -> dict:
    """Extra environment in which `import torch` fails (a package of that name first on
    the path, in `tmp`): for jobs that must end before any rank imports it."""
    (tmp / "torch").mkdir(parents=True, exist_ok=True)
    (tmp / "torch" / "__init__.py").write_text('raise ImportError("torch was imported")\n')
    return {"PYTHONPATH": os.pathsep.join([str(tmp), str(ROOT)])}


def run_mpi(n: int, argv: list[str], timeout: float = 120, env: dict | None = None,
            module: bool = True, check: bool = True) -> subprocess.CompletedProcess:
    """`mpiexec -n N python -m mpi4py ARGV`; kills the process group on timeout.

    MPICH leaves its shared-memory segment in /dev/shm when a job is aborted (several of
    our tests abort on purpose); the segments that appeared during the launch and that no
    live process maps any more are removed, so repeated runs on one machine do not fill
    /dev/shm, while another job's segments (a second test run beside this one) stay."""
    with shm_cleanup():
        return _run_mpi(n, argv, timeout, env, module, check)


@contextlib.contextmanager
def shm_cleanup():
    """Remove the MPICH segments that appeared inside the block and no live process maps."""
    before = _shm_segments()
    try:
        yield
    finally:
        from zerompi.runtime.rundir import clean_dead_shm
        clean_dead_shm(str(SHM), min_age_s=0.0, only=_shm_segments() - before)


def launch_cap(timeout: float) -> float:
    """`timeout`, lowered to $ZEROMPI_TEST_LAUNCH_CAP seconds when that is set (a run
    under a hard time budget, benchmarks/gpu_acceptance.sh, caps every launch)."""
    cap = os.environ.get("ZEROMPI_TEST_LAUNCH_CAP")
    return min(timeout, float(cap)) if cap else timeout


def launch(cmd: list[str], timeout: float = 120, env: dict | None = None,
           stderr_apart: bool = False) -> subprocess.CompletedProcess:
    """Run CMD in its own process group with the test environment; on timeout kill the
    whole group and fail the test. stdout and stderr are merged unless stderr_apart.
    An interrupt (Ctrl-C, or SIGINT from `timeout -s INT` around pytest) kills the
    group too: it is a session of its own, so the signal never reaches it."""
    timeout = launch_cap(timeout)
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE if stderr_apart else subprocess.STDOUT, text=True,
                         env=mpi_env(env, cmd), start_new_session=True)
    t0 = time.monotonic()
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        pytest.fail(f"timeout after {timeout}s: {' '.join(cmd)}\n{out[-4000:]}\n{(err or '')[-2000:]}")
    except BaseException:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        raise
    res = subprocess.CompletedProcess(cmd, p.returncode, out, err)
    res.elapsed = time.monotonic() - t0
    res.ended = time.time()  # wall clock, to compare with a time a rank printed
    return res


def since_all_up(res: subprocess.CompletedProcess) -> float:
    """Seconds from the worker's `all ranks up at T` line (rank 0, after a barrier) to the
    end of the job: how fast a failure ends it, without the start-up, which a loaded
    machine (parallel test workers) stretches by seconds."""
    m = re.search(r"all ranks up at ([0-9]+\.[0-9]{3})", res.stdout)  # anywhere: ranks share the pipe
    assert m, f"no 'all ranks up' line: the job failed before its ranks met\n{res.stdout[-3000:]}"
    return res.ended - float(m.group(1))


@contextlib.contextmanager
def running_job(cmd: list[str], ready, timeout: float = 60, env: dict | None = None):
    """Start CMD (stdout and stderr merged) in its own process group and wait until
    `ready()` holds; yield the Popen for the test to signal. On exit the group is killed
    if it still runs, so a failed assertion leaves nothing behind."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=mpi_env(env, cmd), start_new_session=True)
    try:
        t0 = time.monotonic()
        while not ready():
            if p.poll() is not None:
                pytest.fail(f"ended (exit {p.returncode}) before it was ready: {' '.join(cmd)}\n"
                            + p.communicate()[0][-3000:])
            if time.monotonic() - t0 > timeout:
                pytest.fail(f"not ready after {timeout}s: {' '.join(cmd)}")
            time.sleep(0.005)
        yield p
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()


def _run_mpi(n, argv, timeout, env, module, check) -> subprocess.CompletedProcess:
    cmd = ["mpiexec", "-n", str(n), sys.executable] + (["-m", "mpi4py"] if module else []) + argv
    res = launch(cmd, timeout, env)
    if check and res.returncode != 0:
        pytest.fail(f"exit {res.returncode}: {' '.join(cmd)}\n{res.stdout[-6000:]}")
    return res


def run_worker(n: int, name: str, args: list[str], tmp_path: Path, timeout: float = 180, **kw) -> dict:
    """Run tests/workers/NAME.py on n ranks; it writes its JSON result to --out."""
    out = tmp_path / f"{name}-n{n}-{abs(hash(tuple(args))) % 10**8}.json"
    run_mpi(n, [str(WORKERS / f"{name}.py"), "--out", str(out)] + args, timeout=timeout, **kw)
    return json.loads(out.read_text())
