"""Agreement rounds: how stage-3 ranks decide together which units to gather. This
module is the protocol only: each round returns a `Decision`, which the store
(store.py) acts on.

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
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

NONE = float(2 ** 52)  # "no unit" in a round (above any unit index)


@dataclass(frozen=True)
class Decision:
    """What every rank does after one round: gather `gather` (unit indices, in this
    order); of those, a unit this rank neither wanted nor predicted (`mine`) that it does
    not hold was gathered only for a peer and is released at once. `all_done`: every rank
    said it is done with the phase."""
    gather: tuple[int, ...]
    mine: frozenset[int]
    all_done: bool


class Agreement:
    """The rounds of one stage-3 store over `comm`. `predict()` gives this rank's next
    units as (index, held) pairs, at most `prefetch` of them."""

    def __init__(self, comm, prefetch: int, predict: Callable[[], Sequence[tuple[int, bool]]]):
        self.comm, self.k, self.predict = comm, prefetch, predict
        self.held = 0          # rounds held
        self._pending = None   # a round serve() posted and nobody completed yet
        self._idle, self._backoff, self._next_post = False, 2e-5, 0.0

    def run(self, want: int | None = None, done: bool = False) -> Decision:
        """One blocking round (collective over the group). The round serve() left posted
        must be finished and acted on first (finish_pending): its gathers must be issued
        before this round waits, or a peer blocked on one of them never joins it."""
        assert self._pending is None, "finish_pending() and act on it before a new round"
        h, buf, mine = self._post(want, done)
        h.wait()  # sync: one small all-reduce per round
        return self._decide(buf.tolist(), mine)

    def serve(self) -> list[Decision]:
        """Called repeatedly while this rank waits on something else: keeps a round posted,
        without blocking; the decision of a round that completed meanwhile. After a round
        in which nobody needed anything, the next is posted only after a short, growing
        pause, so ranks that all wait do not spin on rounds."""
        if self._pending is not None:
            if not self._pending[0].test():
                return []
            out = self.finish_pending()
            self._next_post = time.monotonic() + (self._backoff if self._idle else 0.0)
            self._backoff = min(2 * self._backoff, 1e-3) if self._idle else 2e-5
            return out
        if time.monotonic() >= self._next_post:
            self._pending = self._post(None, False)
        return []

    def finish_pending(self) -> list[Decision]:
        """Complete the round serve() posted, if any (rounds are decided in order)."""
        if self._pending is None:
            return []
        h, buf, mine = self._pending
        self._pending = None
        h.wait()
        return [self._decide(buf.tolist(), mine)]

    def _post(self, want: int | None, done: bool):
        preds = [] if done else list(self.predict())[:self.k]
        vals = [-(want if want is not None else NONE)]
        for j in range(self.k):
            if j < len(preds):
                idx, have = preds[j]
                vals += [idx, -idx, -float(have)]
            else:
                vals += [NONE, -NONE, 0.0]
        vals.append(-float(done))
        buf = torch.tensor(vals, dtype=torch.float64)
        h = self.comm.all_reduce(buf, op="max", async_op=True)
        mine = frozenset(idx for idx, _ in preds) | (frozenset() if want is None else {want})
        self.held += 1
        return h, buf, mine

    def _decide(self, r: list[float], mine: frozenset[int]) -> Decision:
        todo = [int(-r[0])] if -r[0] < NONE else []
        for j in range(self.k):
            hi, lo, all_have = r[1 + 3 * j], -r[2 + 3 * j], -r[3 + 3 * j]
            if hi == lo < NONE and all_have < 1 and int(hi) not in todo:
                todo.append(int(hi))
        self._idle = not todo
        return Decision(tuple(todo), mine, -r[-1] >= 1.0)
