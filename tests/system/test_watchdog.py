"""Ending stuck and signalled jobs (issue 14): the watchdog names a stopped rank and
ends the job within its deadline; SIGTERM, a first and a second SIGINT and Slurm's
scancel end a blocked job; uneven step counts are named instead of hanging. Real
mpiexec jobs and signals, a hard deadline per test, no process left behind."""
import contextlib
import os
import signal
import sys
import time

import pytest

from mpirun import ROOT, gone, run_mpi, running_job
from reliability_jobs import FAST, HANG, TRAIN, stopped_rank_job


@pytest.mark.parametrize("mode,stage", [("stop-self", 1), ("stop-in-backward", 3)])
def test_stopped_rank_ends_the_job_naming_it(mode, stage, tmp_path):
    """N = 4, rank 3 SIGSTOPs itself at step 3; timeout_s = 4: the others name rank 3
    and the job ends with exit 3 well within the test's own 60 s deadline, every rank
    gone. stop-in-backward (stage 3): the others wait for a gradient bucket in the loop
    that serves gather rounds (GradReducer._complete), which once ran under no deadline
    and spun forever (tests/system/test_node_loss_soak.py repeats it)."""
    bad = stopped_rank_job(tmp_path, mode, stage)
    assert not bad, "\n".join(bad)


def test_rank_gone_during_a_save_ends_the_job_at_timeout_s(tmp_path):
    """Inside a checkpoint save the deadline is startup_timeout_s (60 s here: writers may
    be slow), but a rank that answers no asking (stopped, or on a lost node) is gone, not
    slow: the others end the job after timeout_s (4 s) and two askings (3 s each)."""
    r = run_mpi(4, [HANG, "stop-in-save", "2", str(tmp_path / "ck")], timeout=60, module=False, check=False)
    assert r.returncode == 3, r.stdout[-3000:]
    assert "during checkpoint save not complete after 4 s (zero.comm.timeout_s; up to " \
           "zero.comm.startup_timeout_s = 60 s" in r.stdout, r.stdout[-3000:]
    assert "rank 3 did not answer" in r.stdout, r.stdout[-3000:]
    assert r.elapsed < 30, r.elapsed


@contextlib.contextmanager
def _blocked_job(tmp_path, mode):
    """hang.py MODE at N = 4 with rank 3 stopped and the others blocked; (Popen, pids)."""
    pidfile = tmp_path / "pid"
    cmd = ["mpiexec", "-n", "4", sys.executable, HANG, mode, "2", str(pidfile)]
    with running_job(cmd, (tmp_path / "pid.stopped").exists) as p:
        time.sleep(1.0)
        yield p, [int((tmp_path / f"pid.{r}").read_text()) for r in range(4)]


def test_sigterm_ends_a_blocked_job(tmp_path):
    """Rank 3 is stopped, the others block in a collective; SIGTERM to mpiexec (which
    forwards it, as scancel signals every task) ends the job within seconds: the ranks
    cannot agree to checkpoint, so none is written; exit 128 + SIGTERM."""
    with _blocked_job(tmp_path, "wait") as (p, pids):
        t_sig = time.monotonic()
        p.send_signal(signal.SIGTERM)
        out, _ = p.communicate(timeout=30)
        took = time.monotonic() - t_sig
    assert p.returncode == 128 + signal.SIGTERM, out[-3000:]
    assert "SIGTERM received, but" in out and "rank 3 did not answer" in out, out[-3000:]
    assert took < 15, took
    deadline = time.monotonic() + 5
    while not all(map(gone, pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(map(gone, pids)), "a rank outlived its job"


def test_uneven_step_counts_end_with_the_ranks_named(tmp_path):
    """A user loop where rank 1 takes one step more than rank 0 (which then idles):
    rank 1's watchdog says where each rank is instead of hanging."""
    r = run_mpi(2, [HANG, "uneven", "2"], timeout=60, module=False, check=False)
    assert r.returncode == 3, r.stdout[-3000:]
    assert "[rank 1] zerompi watchdog:" in r.stdout and "at step 6" in r.stdout, r.stdout[-3000:]
    assert "rank 0 is not in a collective at step 6" in r.stdout, r.stdout[-3000:]


def test_first_sigint_checkpoints_like_sigterm(corpus, tmp_path):
    """Ctrl-C (mpiexec forwards one SIGINT to every rank) on a healthy job: the ranks
    agree, checkpoint and exit 124, as for SIGTERM; no traceback."""
    run_dir = tmp_path / "run"
    cmd = ["mpiexec", "-n", "2"] + TRAIN + FAST + ["--data", corpus, "--run_dir", str(run_dir),
                                                   "--max_steps", "100000", "--checkpoint_interval", "0"]
    path = run_dir / "metrics.jsonl"
    with running_job(cmd, lambda: path.exists() and path.read_text().count("\n") >= 3) as p:
        p.send_signal(signal.SIGINT)
        out, _ = p.communicate(timeout=30)
    assert p.returncode == 124, out[-3000:]
    assert "SIGINT received: checkpoint of step" in out and "Traceback" not in out, out[-3000:]
    assert any(c.name.startswith("step_") for c in (run_dir / "checkpoints").iterdir())


SCANCEL_BATCH = """\
#!/bin/bash
#SBATCH --ntasks=2
#SBATCH --time=5
srun --mpi=pmi2 --kill-on-bad-exit=1 "$@"
rc=$?
echo "BATCH srun rc=$rc"
exit $rc
"""


def test_scancel_signal_ends_a_blocked_slurm_job(slurm_cluster, tmp_path):
    """Under a real Slurm (2 tasks on the 2-CPU test node): rank 1 is stopped, rank 0
    blocks; `scancel --signal=TERM` (the signal only: no SIGKILL follows it, unlike a plain
    scancel after KillWait) ends the job within seconds, the stopped rank named, every
    rank gone."""
    from slurm_jobs import _read, _write

    pidfile = tmp_path / "pid"
    script = _write(tmp_path / "scancel.sbatch", SCANCEL_BATCH, executable=True)
    job = slurm_cluster.sbatch(script, sys.executable, HANG, "wait", "2", str(pidfile),
                               options=[f"--output={tmp_path}/job.log"],
                               env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    try:
        t0 = time.monotonic()
        while not (tmp_path / "pid.stopped").exists():
            assert time.monotonic() - t0 < 90, _read(tmp_path / "job.log")
            time.sleep(0.1)
        time.sleep(1.0)
        t_sig = time.monotonic()
        slurm_cluster.run(["scancel", "--signal=TERM", str(job)])
        state = slurm_cluster.wait(job, timeout=60)
        took = time.monotonic() - t_sig
    finally:
        slurm_cluster.run(["scancel", str(job)], check=False)
    log = _read(tmp_path / "job.log")
    assert state in ("FAILED", "CANCELLED"), (state, log[-3000:])
    assert "SIGTERM received, but" in log and "rank 1 did not answer" in log, log[-3000:]
    assert took < 20, took
    pids = [int((tmp_path / f"pid.{r}").read_text()) for r in range(2)]
    deadline = time.monotonic() + 10
    while not all(map(gone, pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(map(gone, pids)), "a rank outlived its job"


def test_second_sigint_ends_a_blocked_job_at_once(tmp_path):
    """stop_grace_s = 120 s, so the first SIGINT alone would wait; the second ends the
    job at once (exit 130), on the rank that got both."""
    with _blocked_job(tmp_path, "wait-long") as (p, pids):
        os.kill(pids[0], signal.SIGINT)
        time.sleep(1.0)
        assert p.poll() is None, "one SIGINT must not end a job that may still agree"
        t_sig = time.monotonic()
        os.kill(pids[0], signal.SIGINT)
        out, _ = p.communicate(timeout=30)
        took = time.monotonic() - t_sig
    assert p.returncode == 130, out[-3000:]
    assert "[rank 0] zerompi watchdog: a second SIGINT: stopping now, without a checkpoint" in out, out[-3000:]
    assert took < 10, took
