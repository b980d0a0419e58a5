"""The Communicator protocol, and its backend-independent parts: traffic counters and
async handles.

Element counting convention (what `engine.comm_stats()` reports), chosen so that the
numbers read like the ZeRO paper's volumes: all_reduce of n elements counts 2n (it is a
reduce-scatter plus an all-gather), reduce_scatter counts its input n, all_gather its
output n, broadcast n. Seconds are time spent blocked in the call or in `wait()`.
"""
from __future__ import annotations

import time
from collections import defaultdict
from typing import Any, Callable, Protocol, runtime_checkable

from ..runtime.watchdog import waiting


# Chains in flight (chain.py): collectives of several steps whose next step starts only
# when this process polls. A peer may wait on a step this rank has yet to start, so every
# wait below polls them instead of blocking inside MPI while any exists.
ACTIVE_CHAINS: list = []
_progressing = False


def progress_chains() -> bool:
    """Advance every chain in flight as far as it goes without blocking; True if any
    step completed or started. Not re-entrant (a step's own wait may poll)."""
    global _progressing
    if _progressing or not ACTIVE_CHAINS:
        return False
    _progressing = True
    try:
        moved = False
        for c in list(ACTIVE_CHAINS):
            moved = c.advance() or moved
        return moved
    finally:
        _progressing = False


class CommTimeout(RuntimeError):
    """A collective did not complete by its deadline (a peer is stuck or gone)."""


@runtime_checkable
class Communicator(Protocol):
    """What ZeRO needs from a process group. Implemented by MPICommunicator (mpi.py),
    StagedMPICommunicator (staged.py) and NCCLCommunicator (nccl.py).

    Tensors are 1-D contiguous buffers; `send`/`recv` sizes follow the usual collective
    contracts (reduce_scatter: send N*n -> recv n; all_gather: send n -> recv N*n;
    all_to_all: send N*n -> recv N*n, block q of send goes to rank q). With
    async_op=True a call returns a Handle; otherwise it completes before returning
    and returns None."""

    backend: str
    rank: int
    size: int
    carries_gpu_tensors: bool   # moves CUDA tensors (NCCL, CUDA-aware or staged MPI)

    def all_reduce(self, t, op: str = "sum", async_op: bool = False, scratch=None) -> "Handle | None": ...
    def reduce_scatter(self, send, recv, op: str = "sum", async_op: bool = False,
                       scratch=None) -> "Handle | None": ...
    def all_gather(self, send, recv, async_op: bool = False) -> "Handle | None": ...
    def all_to_all(self, send, recv, async_op: bool = False) -> "Handle | None": ...
    def broadcast(self, t, root: int = 0) -> None: ...
    def gather(self, send, recv, root: int = 0) -> None: ...
    def allreduce_scalars(self, values: list[float], op: str = "sum") -> list[float]: ...
    def start_allreduce_scalars(self, values: list[float], op: str = "sum") -> "Scalars":
        """allreduce_scalars without blocking: the result is Scalars.wait()'s."""
    def split(self, color: int, key: int | None = None,
              counted_with: "Communicator | None" = None) -> "Communicator":
        """MPI_Comm_split (collective); counted_with: count the new group's traffic in
        that communicator's stats (e.g. the data-parallel group's comm_stats())."""
    def duplicate(self) -> "Communicator":
        """A private communicator over the same ranks whose traffic counts in this one's
        stats (collective): its messages never match this one's."""
    def set_idle(self, fn: "Callable[[], None] | None") -> None:
        """`fn` runs while a wait on this communicator polls (stage 3 answers its
        agreement rounds there: a peer may need this rank before it can complete)."""
    def barrier(self, poll: bool = False) -> None: ...
    def bcast_object(self, obj: Any, root: int = 0) -> Any: ...
    def allgather_object(self, obj: Any) -> list: ...
    def stats(self) -> dict: ...
    def reset_stats(self) -> None: ...


class CommStats:
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._d: dict[str, dict[str, float]] = defaultdict(
            lambda: {"calls": 0, "elements": 0, "bytes": 0, "seconds": 0.0})

    def record(self, op: str, elements: int, itemsize: int) -> None:
        e = self._d[op]
        e["calls"] += 1
        e["elements"] += int(elements)
        e["bytes"] += int(elements) * int(itemsize)

    def add_time(self, op: str, seconds: float) -> None:
        self._d[op]["seconds"] += seconds

    def as_dict(self) -> dict[str, dict[str, float]]:
        return {k: dict(v) for k, v in self._d.items()}


def next_pause(pause: float, waited: float, chains: bool) -> float:
    """The sleep before a polled wait's next test, after `pause` and `waited` seconds in
    all: doubling from 10 us, so short waits stay fast and long ones cost few wake-ups,
    but never over a tenth of the time waited, so a wait ends at most ~10% after its
    collective does. Doubling alone overshot by up to the whole wait (docs/performance.md,
    "Polled waits"). At most 10 ms (a stuck peer costs 100 wake-ups
    a second); while chains run, 0.2 ms: a peer's next step may be ours to start."""
    return min(2 * pause, max(1e-5, 0.1 * waited), 2e-4 if chains else 1e-2)


class Handle:
    """Completion handle of a non-blocking collective.

    `test()` drives progress without blocking (MPI progresses non-blocking collectives
    only inside MPI calls, so the gradient hooks poke in-flight handles); `wait()`
    blocks, then runs the finishing step (e.g. the ordered sum of a reduce-scatter).
    """

    def __init__(self, stats: CommStats, op: str, wait_fn: Callable[[], None],
                 test_fn: Callable[[], bool], finish: Callable[[], None] | None = None,
                 idle: Callable[[], None] | None = None):
        self._stats, self._op = stats, op
        self._wait_fn, self._test_fn, self._finish = wait_fn, test_fn, finish
        self._idle = idle  # the communicator's `idle` hook: called while this wait polls
        self.done = False

    def test(self) -> bool:
        if self.done:
            return True
        return bool(self._test_fn())

    def wait(self, timeout: float | None = None) -> None:
        """Block until complete. With `timeout` (seconds), raise CommTimeout instead of
        waiting past the deadline, so a stuck peer becomes an error on this rank (which
        the abort hook turns into the end of the job) rather than a hang."""
        if self.done:
            return
        t0 = time.perf_counter()
        with waiting(self._op):  # the watchdog's deadline covers every wait
            if timeout is None and self._idle is None and not ACTIVE_CHAINS:
                self._wait_fn()
            else:
                pause = 1e-5
                while not self._test_fn():
                    moved = progress_chains()
                    if self._idle is not None:
                        self._idle()
                    if timeout is not None and time.perf_counter() - t0 > timeout:
                        raise CommTimeout(f"{self._op}: not complete after {timeout:g} s (a peer rank "
                                          "is stuck, gone, or issued a different collective)")
                    if moved:
                        pause = 1e-5
                        continue
                    time.sleep(pause)
                    pause = next_pause(pause, time.perf_counter() - t0, bool(ACTIVE_CHAINS))
            if self._finish is not None:
                self._finish()
        self.done = True
        self._stats.add_time(self._op, time.perf_counter() - t0)


class Scalars:
    """A non-blocking allreduce_scalars in flight: wait() returns the reduced values."""

    def __init__(self, handle: Handle, buf):
        self.handle, self.buf = handle, buf

    def wait(self) -> list[float]:
        self.handle.wait()
        return self.buf.tolist()


class DoneHandle(Handle):
    """Handle of an operation that already completed (blocking call or size-1 group)."""

    def __init__(self) -> None:
        self.done = True

    def test(self) -> bool:
        return True

    def wait(self, timeout: float | None = None) -> None:
        return None
