"""Leftovers of dead jobs, decided in one process (zerompi/runtime/rundir.py,
zerompi/checkpoint/directory.py): temporary directories of dead owners, zombie owners.
Whole jobs on a run directory: tests/system/test_reliability.py."""
import os
import subprocess
import time


def test_cleanup_touches_only_temporary_directories_of_dead_owners(tmp_path):
    """After a save, cleanup removes the temporary directory of a dead process or of
    unknown owner (a crash before marking), never one whose owner still runs (another
    job's save in progress)."""
    import json
    import socket

    from zerompi.checkpoint.directory import OWNER, cleanup
    from zerompi.runtime.rundir import _start_time

    live = subprocess.Popen(["sleep", "60"])
    dead = subprocess.Popen(["true"])
    dead.wait()
    try:
        for name, pid in ((".tmp-a-live", live.pid), (".tmp-b-dead", dead.pid), (".tmp-c-unmarked", None)):
            (tmp_path / name).mkdir()
            if pid:
                (tmp_path / name / OWNER).write_text(json.dumps(
                    {"host": socket.gethostname(), "pid": pid, "start": _start_time(pid) or "gone"}))
        cleanup(str(tmp_path))
        assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp-a-live"]
    finally:
        live.kill()
        live.wait()


def test_a_zombie_owner_counts_as_gone():
    """A killed rank whose parent is gone may stay a zombie (an init that does not reap, as
    in some containers): its locks and temporary directories belong to nobody."""
    from zerompi.runtime.rundir import _start_time

    z = subprocess.Popen(["true"])  # exits at once; unreaped until wait(): a zombie
    try:
        deadline = time.monotonic() + 10
        while open(f"/proc/{z.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert _start_time(z.pid) is None
        assert _start_time(os.getpid()) is not None
    finally:
        z.wait()
