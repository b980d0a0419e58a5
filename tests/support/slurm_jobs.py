"""Submitting batch scripts to the test Slurm and waiting for them (used by test_slurm*.py)."""
from __future__ import annotations

import re
import sys
import time
from pathlib import Path




REPO = Path(__file__).resolve().parents[2]
PY = sys.executable
# zerompi.train's "stopped by a signal after checkpointing: requeue me" exit code.
REQUEUE_EXIT = 124

# MPICH names its /dev/shm segment after the PMI job id (Slurm job.step) and unlinks it
# once MPI_Init is done; a rank killed before that leaks it, and a later job with the same
# id then dies in MPI_Init ("UCX ERROR failed to unpack address", "Message truncated").
# SlurmCluster draws a random FirstJobId to avoid that; a run that still dies in MPI_Init
# is resubmitted once (new job id), as that is not what these tests are about.
_INIT_FLAKE = re.compile(r"Fatal error in internal_Init_thread|MPI_Init_thread\(.*failed")



def _write(path: Path, text: str, executable: bool = False) -> Path:
    path.write_text(text)
    if executable:
        path.chmod(0o755)
    return path


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _diag(cluster, job_id: int, log: Path) -> str:
    return (f"\n--- job {job_id}: {cluster.job_info(job_id)}\n--- job log {log}:\n{_read(log)}"
            f"\n--- daemon logs:\n{cluster.log_tail(15)}")


def submit_script(cluster, script: Path, name: str, log_dir: Path, *, args=(), options=(),
                  env=None, cwd=None, timeout: float = 120, attempts: int = 2):
    """Submit `script args...`, wait for a final state; resubmit a run that died in MPI_Init.

    Returns (job_id, state, log_path, seconds from submit to final state). The job log
    (stdout+stderr, --open-mode=append) is log_dir/name-<jobid>.log. A run that died in
    MPI_Init (see _INIT_FLAKE) is submitted again, up to `attempts` times in all.
    """
    for attempt in range(1, attempts + 1):
        t0 = time.monotonic()
        job_id = cluster.sbatch(script, *args, env=env, cwd=cwd, options=[
            f"--output={log_dir}/{name}-%j.log", "--open-mode=append", f"--job-name={name}",
            *options])
        state = cluster.wait(job_id, timeout=timeout)
        elapsed = time.monotonic() - t0
        log = log_dir / f"{name}-{job_id}.log"
        if attempt < attempts and state != "COMPLETED" and _INIT_FLAKE.search(_read(log)):
            print(f"{name}: job {job_id} died in MPI_Init; resubmitting")
            continue
        return job_id, state, log, elapsed
    raise AssertionError("unreachable")


def submit_mpi_job(cluster, tmp_path: Path, name: str, batch_text: str, **kw):
    """Write `batch_text` to tmp_path/name.sbatch and submit_script() it (logs in tmp_path)."""
    script = _write(tmp_path / f"{name}.sbatch", batch_text, executable=True)
    return submit_script(cluster, script, name, tmp_path, **kw)


def wait_requeued(cluster, job_id: int, timeout: float) -> dict:
    """Poll until the job is back in the queue after its first run (or ended); its record."""
    from slurm_cluster import TERMINAL_STATES

    deadline = time.monotonic() + timeout
    info: dict = {}
    while time.monotonic() < deadline:
        info = cluster.job_info(job_id)
        if info.get("JobState") in TERMINAL_STATES or (
                info.get("Restarts") == "1" and info.get("JobState") == "PENDING"):
            return info
        time.sleep(0.2)
    raise TimeoutError(f"job {job_id} not requeued after {timeout} s: {info}")
