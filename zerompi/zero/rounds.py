"""Agreement rounds: how stage-3 ranks decide together which units to gather.

Which units are gathered must not depend on every rank running the same modules in the
same order (data-dependent branches, layers skipped per rank, experts that get no token).
A rank that needs a unit it does not hold joins a *round*: one all-reduce (max) of a few
float64 values on a private communicator, in which every rank states the unit it needs
now (if any), its next `prefetch_modules` units along the order it saw last time, whether
it holds them, and whether it is done with the phase:

    [-want, (id, -id, -have) per predicted unit, -done]

From the result every rank takes the same decisions: gather the lowest-numbered unit
anyone needs, plus every predicted unit all ranks predict and not all hold (the
prefetch: in the static case every rank predicts the same units, so gathers run ahead
of compute). A rank that gathers a unit only a peer needs frees it at once. Gathers are
thereby keyed by the agreed unit, so ranks choosing different units can neither hang
nor receive each other's parameters.

While a rank waits on something else (the gradient reducer's buckets), `serve()` keeps
one round posted without blocking, since a peer may need this rank in a round before it
can launch that very bucket.
"""
from __future__ import annotations

import time
from typing import Callable

import torch

NONE = float(2 ** 52)  # "no unit" in a round (above any unit index)


class Rounds:
    """The protocol for one PartitionedParams: `predict()` gives this rank's next units,
    `gather(u, again=True)` / `release(u)` act on the decisions."""

    def __init__(self, comm, units: list, prefetch: int, predict: Callable[[], list],
                 gather: Callable, release: Callable):
        self.comm, self.units, self.k = comm, units, prefetch
        self.predict, self.gather, self.release = predict, gather, release
        self.held = 0      # rounds held
        self.foreign = 0   # units gathered only because a peer needed them (divergence)
        self._pending = None   # a round serve() posted and nobody completed yet
        self._idle, self._backoff, self._next_post = False, 2e-5, 0.0

    def run(self, want=None, done: bool = False) -> bool:
        """One blocking round (collective over the group). True when every rank said it
        is done with the phase."""
        self.finish_pending()
        h, buf, mine = self._post(want, done)
        h.wait()  # sync: one small all-reduce per round
        return self._decide(buf.tolist(), mine)

    def until_all_done(self) -> None:
        """End of a phase: rounds until every rank is done, serving the others meanwhile."""
        self.finish_pending()
        while not self.run(done=True):
            pass

    def serve(self) -> None:
        """Called repeatedly while this rank waits on something else: keeps a round posted,
        without blocking. After a round in which nobody needed anything, the next is posted
        only after a short, growing pause, so ranks that all wait do not spin on rounds."""
        if self._pending is not None:
            if self._pending[0].test():
                self.finish_pending()
                self._next_post = time.monotonic() + (self._backoff if self._idle else 0.0)
                self._backoff = min(2 * self._backoff, 1e-3) if self._idle else 2e-5
            return
        if time.monotonic() >= self._next_post:
            self._pending = self._post(None, False)

    def finish_pending(self) -> None:
        """Complete the round serve() posted, if any (rounds are processed in order)."""
        if self._pending is None:
            return
        h, buf, mine = self._pending
        self._pending = None
        h.wait()
        self._decide(buf.tolist(), mine)

    def _post(self, want, done: bool):
        preds = [] if done else self.predict()
        vals = [-(want.idx if want is not None else NONE)]
        for j in range(self.k):
            if j < len(preds):
                v = preds[j]
                vals += [v.idx, -v.idx, -float(v.state != "free")]
            else:
                vals += [NONE, -NONE, 0.0]
        vals.append(-float(done))
        buf = torch.tensor(vals, dtype=torch.float64)
        h = self.comm.all_reduce(buf, op="max", async_op=True)
        mine = {v.idx for v in preds} | ({want.idx} if want is not None else set())
        self.held += 1
        return h, buf, mine

    def _decide(self, r: list[float], mine: set[int]) -> bool:
        todo = [int(-r[0])] if -r[0] < NONE else []
        for j in range(self.k):
            hi, lo, all_have = r[1 + 3 * j], -r[2 + 3 * j], -r[3 + 3 * j]
            if hi == lo < NONE and all_have < 1 and int(hi) not in todo:
                todo.append(int(hi))
        foreign = []
        for idx in todo:
            u = self.units[idx]
            if u.state == "free" and idx not in mine:
                foreign.append(u)
                self.foreign += 1
            self.gather(u, again=True)
        for u in foreign:  # only a peer needed it
            self.release(u)
        self._idle = not todo
        return -r[-1] >= 1.0
