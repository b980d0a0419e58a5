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
import subprocess
import time
from pathlib import Path

import pytest

from zerompi.runtime import jobs

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

def ranks_of(cmd: list[str] | None) -> int:
    """Processes an `mpiexec -n A ... [: -n B ...]` command starts (0 for other commands)."""
    return jobs.ranks_of(cmd)


def mpi_env(extra: dict | None = None, cmd: list[str] | None = None) -> dict:
    """The test environment of a job (of `cmd`, if it is an mpiexec command): the shared
    launcher's one-machine environment with this checkout first on PYTHONPATH."""
    return jobs.local_env(ROOT, extra, cmd)


def torch_unimportable(tmp: Path) -> dict:
    """Extra environment in which `import torch` fails (a package of that name first on
    the path, in `tmp`): for jobs that must end before any rank imports it."""
    (tmp / "torch").mkdir(parents=True, exist_ok=True)
    (tmp / "torch" / "__init__.py").write_text('raise ImportError("torch was imported")\n')
    return {"PYTHONPATH": os.pathsep.join([str(tmp), str(ROOT)])}


def run_mpi(n: int, argv: list[str], timeout: float = 120, env: dict | None = None,
            module: bool = True, check: bool = True) -> subprocess.CompletedProcess:
    """`mpiexec -n N python -m mpi4py ARGV` through launch(): the process group killed on
    timeout, the MPICH segments the job left in /dev/shm removed."""
    cmd = jobs.mpi_command(n, argv, module=module)
    res = launch(cmd, timeout, env)
    if check and res.returncode != 0:
        pytest.fail(f"exit {res.returncode}: {' '.join(cmd)}\n{res.stdout[-6000:]}")
    return res


@contextlib.contextmanager
def shm_cleanup():
    """Remove the MPICH segments that appeared inside the block and no live process maps
    (for jobs started otherwise than through launch())."""
    before = jobs.shm_segments()
    try:
        yield
    finally:
        jobs.clean_shm(jobs.shm_segments() - before)


def launch_cap(timeout: float) -> float:
    """`timeout`, lowered to $ZEROMPI_TEST_LAUNCH_CAP seconds when that is set (a run
    under a hard time budget, benchmarks/gpu_acceptance.sh, caps every launch)."""
    cap = os.environ.get("ZEROMPI_TEST_LAUNCH_CAP")
    return min(timeout, float(cap)) if cap else timeout


def launch(cmd: list[str], timeout: float = 120, env: dict | None = None,
           stderr_apart: bool = False) -> subprocess.CompletedProcess:
    """Run CMD through the shared launcher (zerompi/runtime/jobs.py: its own session, the
    whole job killed on timeout or interrupt, its dead /dev/shm segments removed) with the
    test environment; a timeout fails the test. stdout and stderr are merged unless
    stderr_apart. The result has `elapsed` (s) and `ended` (wall clock) besides."""
    timeout = launch_cap(timeout)
    job = jobs.run(cmd, timeout=timeout, env=mpi_env(env, cmd), stderr_apart=stderr_apart)
    if job.timed_out:
        pytest.fail(f"timeout after {timeout}s: {' '.join(cmd)}\n{job.output[-4000:]}\n{(job.stderr or '')[-2000:]}")
    res = subprocess.CompletedProcess(cmd, job.returncode, job.output, job.stderr)
    res.elapsed = job.elapsed_s
    res.ended = job.ended
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
    """Start CMD (stdout and stderr merged) through the shared launcher and wait until
    `ready()` holds; yield the Popen for the test to signal. On exit the job is killed if
    it still runs, so a failed assertion leaves nothing behind."""
    p = jobs.start(cmd, mpi_env(env, cmd))
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
            jobs.kill_job(p)
            p.communicate()


def run_worker(n: int, name: str, args: list[str], tmp_path: Path, timeout: float = 180, **kw) -> dict:
    """Run tests/workers/NAME.py on n ranks; it writes its JSON result to --out."""
    out = tmp_path / f"{name}-n{n}-{abs(hash(tuple(args))) % 10**8}.json"
    run_mpi(n, [str(WORKERS / f"{name}.py"), "--out", str(out)] + args, timeout=timeout, **kw)
    return json.loads(out.read_text())
