"""Backend-independent parts of a Communicator: traffic counters and async handles.

Element counting convention (what `engine.comm_stats()` reports), chosen so that the
numbers read like the ZeRO paper's volumes: all_reduce of n elements counts 2n (it is a
reduce-scatter plus an all-gather), reduce_scatter counts its input n, all_gather its
output n, broadcast n. Seconds are time spent blocked in the call or in `wait()`.
"""
from __future__ import annotations

import time
from collections import defaultdict
from typing import Callable


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


class Handle:
    """Completion handle of a non-blocking collective.

    `test()` drives progress without blocking (MPI progresses non-blocking collectives
    only inside MPI calls, so the gradient hooks poke in-flight handles); `wait()`
    blocks, then runs the finishing step (e.g. the ordered sum of a reduce-scatter).
    """

    def __init__(self, stats: CommStats, op: str, wait_fn: Callable[[], None],
                 test_fn: Callable[[], bool], finish: Callable[[], None] | None = None):
        self._stats, self._op = stats, op
        self._wait_fn, self._test_fn, self._finish = wait_fn, test_fn, finish
        self.done = False

    def test(self) -> bool:
        if self.done:
            return True
        return bool(self._test_fn())

    def wait(self) -> None:
        if self.done:
            return
        t0 = time.perf_counter()
        self._wait_fn()
        if self._finish is not None:
            self._finish()
        self.done = True
        self._stats.add_time(self._op, time.perf_counter() - t0)


class DoneHandle(Handle):
    """Handle of an operation that already completed (blocking call or size-1 group)."""

    def __init__(self) -> None:
        self.done = True

    def test(self) -> bool:
        return True

    def wait(self) -> None:
        return None
