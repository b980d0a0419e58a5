"""GatherPool: the fixed buffers stage-3 units are gathered into (store.py).

Why: allocating a unit's full buffer at every gather and freeing it at release sends
tens of MB through the allocator several times a step. On CPUs under glibc each free of
an mmapped block raises the dynamic mmap threshold (up to 32 MiB), after which units,
gradients and activations interleave in the heap, and the heap keeps its high-water mark
(docs/performance.md, "Stage-3 memory"). A GPU's caching allocator hides the
cost, but a fixed pool also bounds gathered memory by the layout, not by the allocator.

Lending without changing storage identity: a unit's parameters are permanent views of
the unit's own storage object (tensors autograd saved for backward are views of it too,
so it must stay the same object). Lending a slot swaps the slot's memory into that
storage (UntypedStorage._swap_data_ptr_, what FSDP2 and CUDA graph trees use); returning
swaps it back, leaving the unit's storage at 0 bytes, so reading a released parameter
still fails as before. Slots are allocated once, through the state's Placement (device
memory on a GPU).

Sizing (`capacities`): in normal operation the units live together are the unit in use,
the next `prefetch_modules` ones (within max_live_parameters), and every unit enclosing
one of those (the model's own unit: its root is still running). For every such window of
consecutive units (flat order: forward and backward walk it in opposite directions) the
sizes are sorted descending; the pool holds the element-wise maximum, so every window fits
slot by slot. More live units than that (nested GatheredParameters, a model reading many
units at once, an order that changes from step to step) get a fresh buffer, freed when
returned, and counted in `fallbacks`: never a wait, never a failure.
"""
from __future__ import annotations

import bisect

import torch


def available() -> bool:
    """torch has storage data-pointer swaps (2.13 here has them; the GPU machine's 2.11 has not:
    benchmarks/results/gpu); otherwise units resize their own storage."""
    return hasattr(torch.UntypedStorage, "_swap_data_ptr_")


def unit_roots(names: list[str]) -> list[list[str]]:
    """Root module names of each unit from its label (units.plan: "h.0+h.1", "<root>")."""
    return [[r if r != "<root>" else "" for r in n.split("+")] for n in names]


def ancestors(names: list[str], persistent: list[bool]) -> list[set[int]]:
    """For every unit, the non-persistent units whose root encloses one of its roots
    (walking up each root's dotted name: linear in the units, not quadratic)."""
    roots = unit_roots(names)
    owner = {r: v for v, rs in enumerate(roots) if not persistent[v] for r in rs}
    out: list[set[int]] = []
    for u, rs in enumerate(roots):
        up: set[int] = set()
        for m in ([] if persistent[u] else rs):
            parts = m.split(".") if m else []
            for k in range(len(parts)):  # proper prefixes: "", "a", "a.b" of "a.b.c"
                v = owner.get(".".join(parts[:k]))
                if v is not None and v != u:
                    up.add(v)
        out.append(up)
    return out


def capacities(names: list[str], persistent: list[bool], sizes: list[int], prefetch: int,
               max_live: int) -> list[int]:
    """Slot sizes (elements, descending) that hold every window of live units (above)."""
    anc = ancestors(names, persistent)
    seq = [u for u in range(len(sizes)) if not persistent[u]]
    need: list[int] = []
    for i, u in enumerate(seq):
        live = {u} | anc[u]
        total = sum(sizes[v] for v in live)
        for v in seq[i + 1:i + 1 + prefetch]:  # as PartitionedParams._predictions
            if v in live:
                continue
            if total + sizes[v] > max_live:
                break
            more = ({v} | anc[v]) - live
            live |= more
            total += sum(sizes[w] for w in more)
        for j, s in enumerate(sorted((sizes[v] for v in live), reverse=True)):
            if j < len(need):
                need[j] = max(need[j], s)
            else:
                need.append(s)
    return need


class _Slot:
    __slots__ = ("storage", "numel", "fresh")

    def __init__(self, storage, numel: int, fresh: bool):
        self.storage, self.numel, self.fresh = storage, numel, fresh


class GatherPool:
    """Slots of `dtype` elements allocated once through `placement`, lent to unit buffers."""

    def __init__(self, placement, dtype: torch.dtype, sizes: list[int]):
        self.placement, self.dtype = placement, dtype
        self.free: list[_Slot] = sorted((self._new(n, False) for n in sizes if n > 0),
                                        key=lambda s: s.numel)  # ascending: first fit = best fit
        self.nbytes = sum(s.storage.nbytes() for s in self.free)
        self.fallbacks = 0        # fresh buffers lent because no free slot was large enough
        self.fallback_bytes = 0   # of those, lent right now

    def _new(self, numel: int, fresh: bool) -> _Slot:
        return _Slot(self.placement.empty(numel, self.dtype).untyped_storage(), numel, fresh)

    def buffer(self, numel: int) -> tuple[torch.Tensor, _Slot | None]:
        """A new flat tensor of `numel` elements on a storage of its own, holding a lent
        slot (so creating a unit's buffer allocates nothing either)."""
        t = torch.empty(0, dtype=self.dtype, device=self.placement.device)
        slot = self.lend(t, numel)
        return t.set_(t.untyped_storage(), 0, (numel,)), slot

    def lend(self, t: torch.Tensor, numel: int | None = None) -> _Slot | None:
        """Give `t`'s empty storage the memory of a slot of at least `numel` elements
        (default t.numel()); returns the slot, for give_back (None: nothing to lend)."""
        n = t.numel() if numel is None else numel
        if n == 0:  # a unit of empty parameters must not hold a real slot
            return None
        i = bisect.bisect_left([s.numel for s in self.free], n)
        if i < len(self.free):
            slot = self.free.pop(i)
        else:
            slot = self._new(n, True)
            self.fallbacks += 1
            self.fallback_bytes += slot.storage.nbytes()
        t.untyped_storage()._swap_data_ptr_(slot.storage)
        return slot

    def give_back(self, t: torch.Tensor, slot: _Slot | None) -> None:
        """`t`'s storage returns to 0 bytes; the slot is free again (a fresh one is freed)."""
        if slot is None:
            return
        t.untyped_storage()._swap_data_ptr_(slot.storage)
        if slot.fresh:
            self.fallback_bytes -= slot.storage.nbytes()
            return  # dropped here: its memory goes back to the allocator
        bisect.insort(self.free, slot, key=lambda s: s.numel)
