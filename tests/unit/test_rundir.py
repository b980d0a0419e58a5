"""Leftovers of dead jobs, decided in one process (zerompi/runtime/rundir.py,
zerompi/checkpoint/directory.py): temporary directories of dead owners, zombie owners,
who may take over a run directory's lock.
Whole jobs on a run directory: tests/system/test_reliability.py."""
import json
import os
import subprocess
import time

import pytest


def test_cleanup_touches_only_temporary_directories_of_dead_owners(tmp_path):
    """After a save, cleanup removes the temporary directory of a dead process or of
    unknown owner (a crash before marking), never one whose owner still runs (another
    job's save in progress)."""
    import socket

    from zerompi.checkpoint.directory import OWNER, cleanup
    from zerompi.runtime.rundir import start_time

    live = subprocess.Popen(["sleep", "60"])
    dead = subprocess.Popen(["true"])
    dead.wait()
    try:
        for name, pid in ((".tmp-a-live", live.pid), (".tmp-b-dead", dead.pid), (".tmp-c-unmarked", None)):
            (tmp_path / name).mkdir()
            if pid:
                (tmp_path / name / OWNER).write_text(json.dumps(
                    {"host": socket.gethostname(), "pid": pid, "start": start_time(pid) or "gone"}))
        cleanup(str(tmp_path))
        assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp-a-live"]
    finally:
        live.kill()
        live.wait()


def test_a_zombie_owner_counts_as_gone():
    """A killed rank whose parent is gone may stay a zombie (an init that does not reap, as
    in some containers): its locks and temporary directories belong to nobody."""
    from zerompi.runtime.rundir import start_time

    z = subprocess.Popen(["true"])  # exits at once; unreaped until wait(): a zombie
    try:
        deadline = time.monotonic() + 10
        while open(f"/proc/{z.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert start_time(z.pid) is None
        assert start_time(os.getpid()) is not None
    finally:
        z.wait()


def test_the_lock_of_another_host_or_an_earlier_run_of_the_job(tmp_path, monkeypatch):
    """A lock from another host is busy while its heartbeat is fresh (naming host, pid and
    Slurm job) and stale after STALE_S; a lock of the same Slurm job's earlier run (a
    requeue: lower SLURM_RESTART_COUNT) is taken over at once, whatever its host."""
    from zerompi.runtime.rundir import LOCK, STALE_S, RunDirBusy, RunLock

    lock = tmp_path / LOCK

    def acquire() -> str:
        held = RunLock(tmp_path).acquire()
        held.release()
        assert not lock.exists()
        return held.took_over

    other = {"host": "node-elsewhere", "pid": 1, "start": "1", "slurm_job_id": "4242",
             "slurm_restart_count": 0, "since": "earlier"}
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    lock.write_text(json.dumps(other))
    assert acquire().endswith(": an earlier run of this Slurm job (requeued)")

    monkeypatch.delenv("SLURM_JOB_ID")
    monkeypatch.delenv("SLURM_RESTART_COUNT")
    lock.write_text(json.dumps(dict(other, slurm_job_id="5000")))
    with pytest.raises(RunDirBusy, match="is in use by another job \\(host node-elsewhere, pid 1, Slurm job 5000"):
        acquire()
    old = time.time() - STALE_S - 600  # its heartbeat stopped
    os.utime(lock, (old, old))
    took = acquire()
    assert took.startswith("took over the lock of host node-elsewhere, pid 1") and ": not refreshed for 9" in took, took
