"""The helper process of asynchronous saves with writer = "process": one per rank,
started once, writing rank files from the rank's staging buffer (a memfd it maps).

    python -m zerompi.checkpoint.background.helper FD NBYTES NICE PARENT_PID

It imports numpy and h5py only (no torch, no MPI), runs at nice NICE, ignores the stop
signals (its rank decides what happens to a save in flight), dies with its rank
(PR_SET_PDEATHSIG), and ends when its stdin closes. Messages both ways are pickles
behind an 8-byte length: ("rank", path, job) or ("meta", tmp, manifest) in,
("ok", result) or ("error", exception class name, errno, text) out.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import pickle
import signal
import struct
import sys

_LEN = struct.Struct("<Q")


class RemoteError(Exception):
    """An exception of the helper, as the rank sees it: the same class name and text
    (so the message is the one a synchronous save gives), and its errno."""

    def __init__(self, kind: str, errno: int | None, text: str):
        super().__init__(text)
        self.kind, self.errno = kind, errno


def send(f, obj) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    f.write(_LEN.pack(len(data)) + data)
    f.flush()


def recv(f):
    """The next message, or None at end of file."""
    head = f.read(_LEN.size)
    if len(head) < _LEN.size:
        return None
    (n,) = _LEN.unpack(head)
    data = f.read(n)
    return pickle.loads(data) if len(data) == n else None


def _die_with_parent(parent: int) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:   # the rank died before the call above
        os._exit(1)


def lower_priority(nice: int) -> None:
    """nice NICE for this process and for its autogroup. The helper has a session of its
    own (a signal to the rank's process group does not reach it), and with
    kernel.sched_autogroup_enabled a session is a scheduling group: the scheduler first
    shares the cores between groups, and a nice value counts only inside its group. Without
    the second write the helper competed as an equal of a rank (mpiexec gives each rank a
    session too), whatever its nice: steps 1.25-1.5x during a write at N = ranks = cores."""
    try:
        os.nice(nice)
    except OSError:
        pass
    try:
        with open("/proc/self/autogroup", "w") as f:   # absent without autogroups: nothing to do
            f.write(str(nice))
    except OSError:
        pass


def main(argv: list[str]) -> int:
    fd, nbytes, nice, parent = (int(x) for x in argv)
    _die_with_parent(parent)
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        signal.signal(s, signal.SIG_IGN)
    import numpy as np

    from ..index import write_metadata
    from ..rankfile_h5 import write_staged

    lower_priority(nice)   # after the imports (a second of CPU once), which would crawl at nice 19

    buf = np.frombuffer(mmap.mmap(fd, nbytes), dtype=np.uint8)
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    while True:
        msg = recv(stdin)
        if msg is None:
            return 0
        what, path, arg = msg
        try:
            reply = ("ok", write_staged(path, arg, buf) if what == "rank" else write_metadata(path, arg))
        except Exception as e:
            reply = ("error", type(e).__name__, getattr(e, "errno", None), str(e))
        send(stdout, reply)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
