"""Reliability under the faults clusters produce (issue 14): real mpiexec jobs, real
signals, real files, a hard deadline per test, and no process left behind.

- a stopped rank (SIGSTOP: a dead node, a hung GPU) ends the job within the deadline,
  named by the others' watchdogs; SIGTERM ends a blocked job within seconds.
"""
import os
import signal
import subprocess
import sys
import time

import pytest

from mpirun import WORKERS, mpi_env, run_mpi

HANG = str(WORKERS / "hang.py")


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # a zombie has exited; only its parent has not reaped it yet
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] == "Z"


@pytest.mark.parametrize("stage", [1, 3])
def test_stopped_rank_ends_the_job_naming_it(stage):
    """N = 4, rank 3 SIGSTOPs itself at step 3; timeout_s = 4: the others name rank 3
    and the job ends with exit 3 well within the test's own 60 s deadline."""
    r = run_mpi(4, [HANG, "stop-self", str(stage)], timeout=60, module=False, check=False)
    assert r.returncode == 3, r.stdout[-3000:]
    assert "zerompi watchdog: " in r.stdout and "not complete after 4 s (zero.comm.timeout_s)" in r.stdout
    assert "rank 3 did not answer" in r.stdout, r.stdout[-3000:]
    assert "at step 4" in r.stdout  # the step in progress, 1-based as in metrics.jsonl
    assert r.elapsed < 30, r.elapsed


def test_sigterm_ends_a_blocked_job(tmp_path):
    """Rank 3 is stopped, the others block in a collective; SIGTERM to mpiexec (which
    forwards it, as scancel signals every task) ends the job within seconds: the ranks
    cannot agree to checkpoint, so none is written; exit 128 + SIGTERM."""
    pidfile = tmp_path / "pid"
    p = subprocess.Popen(["mpiexec", "-n", "4", sys.executable, HANG, "wait", "2", str(pidfile)],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=mpi_env(),
                         start_new_session=True)
    try:
        t0 = time.monotonic()
        while not (tmp_path / "pid.stopped").exists():
            assert p.poll() is None and time.monotonic() - t0 < 60, "job ended before the stop"
            time.sleep(0.05)
        time.sleep(1.0)  # the others are now blocked in the step's collectives
        t_sig = time.monotonic()
        p.send_signal(signal.SIGTERM)
        out, _ = p.communicate(timeout=30)
        took = time.monotonic() - t_sig
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
    assert p.returncode == 128 + signal.SIGTERM, out[-3000:]
    assert "SIGTERM received, but" in out and "rank 3 did not answer" in out, out[-3000:]
    assert took < 15, took
    pids = [int((tmp_path / f"pid.{r}").read_text()) for r in range(4)]
    deadline = time.monotonic() + 5
    while not all(map(_gone, pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(map(_gone, pids)), "a rank outlived its job"


@pytest.fixture
def small_fs(tmp_path):
    """A 4 MiB tmpfs: a real filesystem that really fills up (needs root)."""
    mnt = tmp_path / "fs"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_disk_full_during_save_leaves_nothing_behind(small_fs, tmp_path):
    """The filesystem fills up during the second save: every rank gets the error, which
    names the file and the space needed; the first checkpoint stays, `latest` names it,
    and no temporary directory is left."""
    out = tmp_path / "out.json"
    run_mpi(2, [str(WORKERS / "diskfull.py"), str(small_fs / "ck"), str(out)], timeout=90)
    import json

    res = json.loads(out.read_text())
    assert all(e is not None for e in res["errors"]), res
    msg = res["errors"][0]
    assert "rank-0000" in msg and ".h5" in msg and "out of space" in msg and "MiB free there now" in msg, msg
    assert "needs about" in msg and "the previous checkpoint is untouched" in msg
    assert res["listing"] == ["a", "latest"], res["listing"]
    assert res["latest"] == "a"
