"""The asynchronous save's helper process yields to training: nice for the process and
for its autogroup (its own session is its own scheduling group, where a nice value alone
counts for nothing against the ranks' group); it never imports torch."""
import os
import time
from types import SimpleNamespace

import pytest

from zerompi.checkpoint.background.writers import ProcessWriter


def _autogroup_nice(pid: int) -> int | None:
    """The nice of PID's autogroup; None where PID is in the root group (the kernel prints
    nothing then: e.g. a CI container whose processes never started a session of their own)."""
    with open(f"/proc/{pid}/autogroup") as f:   # "/autogroup-123 nice 19"
        fields = f.read().split()
    return int(fields[-1]) if fields else None


@pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="the process writer needs memfd_create (Linux)")
def test_the_helper_process_runs_at_the_writer_nice_in_its_own_autogroup_too():
    fd = os.memfd_create("zerompi-test-staging")
    os.ftruncate(fd, 1 << 16)
    writer = ProcessWriter(SimpleNamespace(fd=fd, nbytes=1 << 16), nice=17)
    try:
        pid = writer.proc.pid
        groups = os.path.exists(f"/proc/{pid}/autogroup")   # kernels with CONFIG_SCHED_AUTOGROUP

        def lowered():  # the helper sets its nice, then its group's (already at nice 17: may lag)
            return os.getpriority(os.PRIO_PROCESS, pid) == 17 and (not groups or _autogroup_nice(pid) == 17)
        deadline = time.monotonic() + 60   # it lowers its priority after its imports
        while not lowered() and time.monotonic() < deadline:
            assert writer.proc.poll() is None, "the helper ended"
            time.sleep(0.05)
        assert os.getpriority(os.PRIO_PROCESS, pid) == 17
        assert os.getsid(pid) != os.getsid(0), "the helper is meant to have a session of its own"
        if groups:
            assert _autogroup_nice(pid) == 17
            assert _autogroup_nice(os.getpid()) != 17, "the test process's own group must be untouched"
    finally:
        writer.close()
        os.close(fd)
    assert writer.proc.returncode == 0


@pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="the process writer needs memfd_create (Linux)")
def test_the_helper_never_imports_torch(tmp_path):
    """What a rank sends its helper (rank-file jobs; on rank 0 the manifest too) unpickles
    without torch, so the helper stays numpy + h5py: ~0.15 CPU-s to start, not ~1.3 more and
    torch's libraries mapped (a TorchVersion in the manifest once pulled torch in)."""
    import torch

    import zerompi
    import zerompi.checkpoint

    torch.manual_seed(0)
    engine = zerompi.initialize(torch.nn.Linear(4, 4), {"stage": 2})
    zerompi.checkpoint.save(engine, tmp_path, async_save=True)
    zerompi.checkpoint.flush(engine)  # the rank file and the manifest went through the helper
    saver = engine.checkpoint_view().saver
    try:
        assert (tmp_path / "latest").exists() and saver.writer.proc.poll() is None
        with open(f"/proc/{saver.writer.proc.pid}/maps") as f:
            assert "libtorch" not in f.read()
    finally:
        saver.close()
