"""Stage 3's secondary partition (zero.stage3.secondary_partition; ZeRO++'s hpZ): backward
re-gathers a unit inside a small group (the node) instead of across the shard group.

Forward gathers each unit from the primary shards over the shard group, as always; when
that gather completes, every rank copies its slice of the unit's low-precision values
into a buffer of its own: block k of the unit, cut into P equal pieces (P = the secondary
group's size; blocks are multiples of N x alignment and P divides N), piece `rank in the
group`. A gather in backward then all-gathers those pieces over the secondary group.

Why it is exact. The pieces are copies of what the forward gather delivered, so the
unit re-gathered in backward is bitwise the forward's. A unit's secondary copy is valid
only between a primary gather of it and the next change of the shards: every optimizer
update, a checkpoint or full-state load (both end in after_update) and a
GatheredParameters write-back invalidate all copies, so a backward that finds no valid
copy (its forward ran before an update, or never ran here) gathers from the primary
shards instead. Validity changes only at points every rank of the shard group passes in
the same order (agreed gathers, updates), so all ranks choose the same source for every
gather. The reference implementation's "wrong first step" came from reading a secondary
copy before anything had filled it; here the copy exists only after a forward gather.

Memory: sum over non-persistent units of unit / P elements in the param dtype
(`memory_report()["secondary"]`).
"""
from __future__ import annotations

import torch


class Secondary:
    def __init__(self, comm, layout, units: list, placement, dtype: torch.dtype):
        self.comm, self.layout = comm, layout
        self.P, self.rank = comm.size, comm.rank
        self.off: dict[int, int] = {}  # block -> offset of this rank's piece in `buf`
        total = 0
        for u in units:
            if u.persistent:
                continue  # always gathered: nothing to re-gather
            for k in u.blocks:
                s, e = layout.blocks[k]
                if (e - s) % self.P:
                    raise ValueError(f"block of {e - s} elements does not split over {self.P} ranks")
                self.off[k] = total
                total += (e - s) // self.P
        self.buf = placement.empty(total, dtype)
        self.valid = [False] * len(units)
        self.fills = 0  # units copied (for tests: the copy happens on every forward gather)

    @property
    def nbytes(self) -> int:
        return self.buf.numel() * self.buf.element_size()

    def usable(self, u, phase: str) -> bool:
        """Gather `u` from the secondary copies now? Backward only, and only when valid."""
        return phase == "backward" and not u.persistent and self.valid[u.idx]

    def _pieces(self, u):
        for k in u.blocks:
            s, e = self.layout.blocks[k]
            piece = (e - s) // self.P
            yield self.buf[self.off[k]:self.off[k] + piece], s - u.lo, e - u.lo, piece

    def fill(self, u) -> None:
        """After a primary gather of `u` completed: keep this rank's slice of each block."""
        for mine, lo, _, piece in self._pieces(u):
            mine.copy_(u.full[lo + self.rank * piece:lo + (self.rank + 1) * piece])
        self.valid[u.idx] = True
        self.fills += 1

    def gather(self, u) -> list:
        """All-gathers of `u`'s blocks over the secondary group (async handles)."""
        return [self.comm.all_gather(mine, u.full[lo:hi], async_op=True) for mine, lo, hi, _ in self._pieces(u)]

    def invalidate(self) -> None:
        self.valid = [False] * len(self.valid)
