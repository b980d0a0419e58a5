"""Chains: one collective made of several non-blocking steps on different communicators
(a reduce-scatter inside the node, then one across nodes), advanced by polling.

MPI cannot start the second step of such a collective by itself: its input is the first
step's output after a local sum. So a chain is a list of steps, each (communicator,
start -> Handle, optional local work after it completes), and `advance()` moves it on
whenever this process polls: every test or wait of any handle polls every chain in
flight (base.progress_chains), because a peer blocked on our next step cannot proceed
until we start it, wherever we happen to be waiting.

Order. MPI needs every rank to start the collectives of one communicator in the same
order, but chains complete their steps at different moments on different ranks. So
each communicator keeps a queue: a chain reserves its steps on their communicators when
it is created, and a step starts only when it is at the head of its communicator's
queue. Chains are created in the same order on every rank (the engine's agreed block and
unit order), so every communicator sees the same sequence everywhere.
"""
from __future__ import annotations

import time
from collections import deque
from typing import Any, Callable, Sequence

from ..runtime.watchdog import waiting
from .base import ACTIVE_CHAINS, CommStats, CommTimeout, Handle, progress_chains


class Step:
    __slots__ = ("comm", "start", "post")

    def __init__(self, comm: Any, start: Callable[[], Any], post: Callable[[], None] | None = None):
        self.comm, self.start, self.post = comm, start, post


def _queue(comm) -> deque:
    q = getattr(comm, "_chain_queue", None)
    if q is None:
        q = comm._chain_queue = deque()
    return q


class Chain(Handle):
    """A collective of `steps`, started at construction as far as the queues allow."""

    def __init__(self, stats: CommStats, op: str, steps: Sequence[Step], keep: tuple = ()):
        self._stats, self._op, self._idle = stats, op, None
        self.steps, self.i, self.h, self.keep = list(steps), 0, None, keep
        self.done = not self.steps
        if self.done:
            return
        for st in self.steps:
            _queue(st.comm).append(st)
        ACTIVE_CHAINS.append(self)
        self.advance()

    def advance(self) -> bool:
        """Complete and start steps while possible, without blocking. True if it moved."""
        moved = False
        while not self.done:
            st = self.steps[self.i]
            if self.h is None:
                q = _queue(st.comm)
                if q[0] is not st:
                    return moved  # an earlier chain's step goes first on this communicator
                q.popleft()
                self.h = st.start()
                moved = True
            if not self.h.test():
                return moved
            self.h.wait()  # the step's own finish (an ordered sum), no blocking left
            if st.post is not None:
                st.post()
            self.h, self.i, moved = None, self.i + 1, True
            if self.i == len(self.steps):
                self.done = True
                ACTIVE_CHAINS.remove(self)
                self.keep = ()
        return moved

    def test(self) -> bool:
        if not self.done:
            progress_chains()
        return self.done

    def wait(self, timeout: float | None = None) -> None:
        if self.done:
            return
        t0 = time.perf_counter()
        pause = 1e-5
        with waiting(self._op):
            while not self.done:
                if progress_chains():
                    pause = 1e-5
                    continue
                if self.done:
                    break
                if timeout is not None and time.perf_counter() - t0 > timeout:
                    raise CommTimeout(f"{self._op}: not complete after {timeout:g} s (step {self.i + 1} "
                                      f"of {len(self.steps)}; a peer rank is stuck or gone)")
                time.sleep(pause)
                pause = min(2 * pause, 2e-4)
        self._stats.add_time(self._op, time.perf_counter() - t0)


def run(stats: CommStats, op: str, steps: Sequence[Step], async_op: bool, keep: tuple = ()):
    """Start a chain; return it (async_op) or wait for it and return None."""
    ch = Chain(stats, op, steps, keep)
    if async_op:
        return ch
    ch.wait()
    return None
