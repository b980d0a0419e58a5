"""PartitionedParams (stage 3): between uses every rank holds only its shard.

- Units (units.py): module subtrees gathered together when their root module runs,
  laid out on whole blocks of the flat space (one all-gather per block). Small
  parameters (<= stage3.persistence_threshold) form one persistent unit that stays
  gathered and is refreshed after each update.
- Gather/release. Every unit owns a flat buffer of its full size; the parameters are
  permanent views of it. Gathering lends the buffer's *storage* the memory of a slot of
  a fixed pool (gather_pool.py) and fills it; releasing returns the slot and leaves the
  storage at zero bytes, so tensors autograd saved for backward (often views such as
  weight.t()) neither pin memory nor go stale, and no step allocates gather buffers.
    root forward pre-hook  -> gather the unit (a prefetched one just waits)
    root forward post-hook -> release it (a coalesced unit of several sibling roots: after
                              its last root); hook the outputs so that backward gathers again
    the unit's last gradient accumulated -> release it (gradients go through the
    per-bucket reduce-scatter of grads.py into the gradient shard)
- Agreement rounds (agreement.py, decisions this store carries out): what is gathered never depends on every rank running
  the same modules in the same order. A rank that needs a unit it does not hold joins a
  round; all ranks take the same gather decisions from it, prefetch included. A phase
  (forward, backward) ends with rounds until every rank is done, and blocking waits
  inside backward keep serving rounds (`serve`).
- Alone (a shard group of one rank, `resident`): the shard is the whole model in the flat
  layout, so every unit is a permanent view of it: no pool, gather, release, round or
  hook; the update writes the parameters themselves (as FSDP2 skips its world-1 gather).
"""
from __future__ import annotations

import contextlib
from typing import Iterable

import torch
import torch.nn as nn

from ...runtime.malloc import HeapTrimmer
from .. import compiled, flat
from ..init_context import adopt
from ..params import Plan, keep_changes
from ..weak_hooks import weakly
from . import gather_pool, units as units_mod
from .agreement import Agreement, Decision
from .secondary import Secondary
from .units import Unit, alloc_storage, free_storage, output_tensors as _tensors

class PartitionedParams:
    """Stage 3: only shards between uses; units gathered just in time (see above)."""

    plan = staticmethod(units_mod.plan)

    def __init__(self, plan: Plan, params: list, names: list[str], layout, state, comm, cfg,
                 owns_all: bool = False, groups=None):
        # comm: the shard group (gathers, rounds); dp: every data-parallel rank (rank 0's values)
        self.params, self.names, self.layout, self.state, self.comm = params, names, layout, state, comm
        dp = self.dp = groups.dp if groups is not None else comm
        self.cfg, self.model = cfg.stage3, plan.model
        self.resident = comm.size == 1  # the shard is every unit's storage (docstring)
        # Gathers on a private duplicate (counted with the group's traffic), rounds on
        # another (control messages); resident: neither runs, so neither is made.
        self.gcomm = None if self.resident else comm.duplicate()
        self.units: list[Unit] = []
        self.unit_of: dict[int, Unit] = {}
        pl, dtype = state.placement, state.param_dtype
        self.pool = None  # torch without storage swaps: units resize their own storage
        if gather_pool.available() and not self.resident:
            sizes = [hi - lo for lo, hi in layout.unit_spans]
            self.pool = gather_pool.GatherPool(pl, dtype, gather_pool.capacities(
                plan.unit_names, plan.unit_persistent, sizes, self.cfg.prefetch_modules,
                self.cfg.max_live_parameters))
        for u, (blocks, span, pidx) in enumerate(zip(layout.unit_blocks, layout.unit_spans, layout.unit_params)):
            unit = Unit(u, plan.unit_names[u], plan.unit_roots[u], list(pidx), blocks, span,
                         plan.unit_persistent[u])
            # Identical start everywhere, one unit at a time: values come from the
            # partitioned construction (zerompi.Init) or from rank 0's full tensors.
            pooled = self.pool is not None and not unit.persistent
            if self.resident:
                unit.full = state.shard_param[unit.lo:unit.hi]
            elif pooled:  # the unit's storage, on a lent slot: set-up allocates no unit buffers
                unit.full, unit.slot = self.pool.buffer(unit.size)
            full32 = (unit.full if pooled and dtype == torch.float32
                      else pl.empty(unit.size, torch.float32)).zero_()
            from_rank0 = False
            for i in unit.params:
                p = params[i]
                o, n = layout.offsets[i] - unit.lo, layout.numels[i]
                piece = getattr(p, "_zero_init", None)
                if piece is not None:
                    if piece.world != dp.size:
                        raise ValueError(f"parameter {names[i]} was built under zerompi.Init over "
                                         f"{piece.world} ranks, but the engine's data-parallel group "
                                         f"has {dp.size}: pass the same dims to Init and initialize")
                    full32[o:o + n].copy_(adopt(p).reshape(-1))
                else:
                    full32[o:o + n].copy_(p.detach().reshape(-1))
                    from_rank0 = True
            if from_rank0:
                dp.broadcast(full32, root=0)
            state.set_full(full32, blocks=blocks, base=unit.lo)  # resident: into unit.full too
            if pooled and dtype != torch.float32:
                unit.full.copy_(full32)
            elif not pooled and not self.resident:
                unit.full = full32 if dtype == torch.float32 else pl.empty(unit.size, dtype).copy_(full32)
            del full32
            for i in unit.params:
                o, n = layout.offsets[i] - unit.lo, layout.numels[i]
                params[i].data = unit.full[o:o + n].view(params[i].shape)
                self.unit_of[id(params[i])] = unit
            if unit.persistent or self.resident:
                unit.state = "ready"
            elif pooled:
                self.pool.give_back(unit.full, unit.slot)
                unit.slot = None
            else:
                free_storage(unit.full)
            self.units.append(unit)
        sec = groups.secondary if groups is not None and not self.resident else None  # secondary.py
        self.secondary = Secondary(sec, layout, self.units, pl, dtype) if sec is not None else None
        self._live = 0  # gathered elements of non-persistent units
        self._trim = HeapTrimmer(pl)  # host: backward's freed transients back to the OS
        self._phase = "idle"
        self._seq: list[int] = []                     # this phase's unit requests
        self._trace: dict[str, list[int]] = {"forward": [], "backward": []}  # last time's
        self._cursor = 0
        self.agreement = Agreement(comm if self.resident else comm.split(0, comm.rank), self.cfg.prefetch_modules,
                                   lambda: [(v.idx, v.state != "free") for v in self._predictions()])
        self.foreign = 0  # units gathered only because a peer needed them (divergence)
        self._hooks = []
        if self.resident:
            self.serve = None  # nothing to serve while the reducer waits
            return
        compiled.before_hooks()  # no graph traced without these hooks may run (zero/compiled.py)
        for u in self.units:
            for j, root in enumerate(u.roots):
                self._hooks.append(root.register_forward_pre_hook(weakly(self, "_pre_forward", u.idx)))
                self._hooks.append(root.register_forward_hook(
                    weakly(self, "_post_forward", u.idx, j == len(u.roots) - 1)))
        for p in params:
            self._hooks.append(p.register_post_accumulate_grad_hook(
                weakly(self, "_grad_done", self.unit_of[id(p)].idx)))

    # ------------------------------------------------------------------ phases (engine calls)
    # On an exception in forward/backward nothing below runs: waiting on in-flight
    # gathers could block on peers that will never match them (see ZeroEngine.backward).
    def start_forward(self) -> None:
        self._begin("forward")

    def finish_forward(self) -> None:
        self._end("forward")

    def start_backward(self) -> None:
        for u in self.units:
            u.pending = len(u.params)
        self._begin("backward")

    def finish_backward(self) -> None:
        self._end("backward")

    def _begin(self, phase: str) -> None:
        self._phase, self._cursor, self._seq = phase, 0, []

    def _end(self, phase: str) -> None:
        if self.resident:
            return
        while not self._round(done=True):  # sync: no rank moves on while a peer needs it
            pass
        self._release_all()  # prefetched but unused units, and anything left gathered
        self._trace[phase] = self._seq
        self._phase = "idle"

    def serve(self) -> None:
        """grads.GradReducer polls this instead of blocking (Agreement.serve)."""
        self._act(self.agreement.serve())

    def after_update(self) -> None:
        """Only persistent units are kept gathered: refresh them from the new shards.
        Secondary copies hold the old values: invalid until the next forward gather."""
        if self.secondary is not None:
            self.secondary.invalidate()
        if self.resident:
            return  # the update wrote the shard, which every unit views
        for u in self.units:
            if u.persistent:
                u.state = "free"
                self._gather(u)
                self._wait(u)

    # ------------------------------------------------------------------ agreement
    def _predictions(self) -> list[Unit]:
        """The next units along last time's order that fit within max_live_parameters."""
        trace = self._trace.get(self._phase) or []
        out, live = [], self._live
        for idx in trace[self._cursor:self._cursor + self.cfg.prefetch_modules]:
            v = self.units[idx]
            if v.state == "free":
                if live + v.size > self.cfg.max_live_parameters:
                    break
                live += v.size
            out.append(v)
        return out

    def _fetch(self, u: Unit) -> None:
        if u.persistent:
            return
        if len(u.roots) < 2 or not self._seq or self._seq[-1] != u.idx:  # coalesced: next root, same request
            self._seq.append(u.idx)
            trace = self._trace.get(self._phase) or []
            try:
                self._cursor = trace.index(u.idx, self._cursor) + 1
            except ValueError:
                pass
        if u.state == "free":
            while u.state == "free":
                self._round(want=u.idx)
        elif any(v.state == "free" for v in self._predictions()):
            self._round()  # keep the prefetch window full
        self._wait(u)

    def _round(self, want: int | None = None, done: bool = False) -> bool:
        """A round after acting on the one serve() left posted; True: every rank is done."""
        self._act(self.agreement.finish_pending())
        return self._act([self.agreement.run(want, done)])

    def _act(self, decisions: list[Decision]) -> bool:
        """Carry out decisions in order; True when the last says all are done."""
        for d in decisions:
            foreign = [self.units[i] for i in d.gather if self.units[i].state == "free" and i not in d.mine]
            for i in d.gather:
                self._gather(self.units[i], again=True)
            for u in foreign:  # only a peer needed it
                self._release(u)
            self.foreign += len(foreign)
        return bool(decisions) and decisions[-1].all_done

    # ------------------------------------------------------------------ gather / release
    def _gather(self, u: Unit, again: bool = False) -> None:
        """Start the all-gather of `u` (every rank of the group issues the same ones).
        again: also when held already (a peer needs it; the values are the same)."""
        if u.state != "free" and not again:
            return
        if u.state == "inflight":
            self._wait(u)  # never two outstanding receives into one buffer
        if u.state == "free" and not u.persistent:  # persistent: refreshed in its own buffer
            if self.pool is not None:
                u.slot = self.pool.lend(u.full)
            else:
                alloc_storage(u.full)
            self._live += u.size
        sec = self.secondary
        if sec is not None and sec.usable(u, self._phase):  # backward: inside the node only
            u.handles, u.fill = sec.gather(u), False
        else:
            shard = self.state.shard_param
            u.handles = [self.gcomm.all_gather(shard[sp.shard], u.full[sp.block], async_op=True)
                         for sp in self.layout.spans(self.state.own, u.blocks, u.lo)]
            u.fill = sec is not None and not u.persistent
        u.state = "inflight"

    def _wait(self, u: Unit) -> None:
        if u.state == "inflight":
            for h in u.handles:
                h.wait()
            u.handles = []
            u.state = "ready"
            if u.fill:  # a primary gather: keep this rank's slice for backward
                self.secondary.fill(u)
                u.fill = False

    def _release(self, u: Unit) -> None:
        if u.persistent or u.state == "free":
            return
        self._wait(u)
        if self.pool is not None:
            self.pool.give_back(u.full, u.slot)
            u.slot = None
        else:
            free_storage(u.full)
        u.state = "free"
        self._live -= u.size

    def _release_all(self) -> None:
        for u in self.units:
            self._release(u)

    # ------------------------------------------------------------------ hooks
    # Each takes the unit's index and the hook's own arguments, and returns None (a value
    # returned by a forward or gradient hook would replace the output or the gradient).
    def _pre_forward(self, u: int, mod, args) -> None:
        self._fetch(self.units[u])

    def _post_forward(self, u: int, last: bool, mod, args, output) -> None:
        if self._phase == "backward":
            return  # recomputation (activation checkpointing): backward still needs it
        if last:  # a coalesced unit stays gathered for its next roots (else: phase end)
            self._release(self.units[u])
        if torch.is_grad_enabled():
            for t in _tensors(output):
                if t.requires_grad:
                    t.register_hook(weakly(self, "_pre_backward", u))

    def _pre_backward(self, u: int, grad) -> None:
        self._fetch(self.units[u])

    def _grad_done(self, u: int, p) -> None:
        unit = self.units[u]
        unit.pending -= 1
        if unit.pending == 0:
            self._release(unit)
            self._trim.released(unit.size * unit.full.element_size())  # ~ its gradients' bytes

    # ------------------------------------------------------------------ errors
    def explain(self, exc: BaseException) -> Exception | None:
        """Our error for a read of a released parameter (units.explain_released_read)."""
        released = {id(self.params[i]): (self.names[i], u.name) for u in self.units
                    if u.state == "free" for i in u.params}
        return units_mod.explain_released_read(exc, released, self.model, self.cfg.unit_classes)

    # ------------------------------------------------------------------ whole-model access
    def full_state(self, all_ranks: bool) -> dict[str, torch.Tensor]:
        """fp32 parameters, streamed unit by unit to rank 0 (every rank with all_ranks):
        other ranks never hold more than one unit's chunk."""
        st, out = self.state, {}
        src = (st.master if st.mixed else st.shard_param).to(st.placement.device)  # offloaded: host master
        keep = all_ranks or self.comm.rank == 0
        for u in self.units:
            buf = st.placement.empty(u.size, torch.float32) if keep else None
            for sp in self.layout.spans(st.own, u.blocks, u.lo):
                if all_ranks:
                    self.comm.all_gather(src[sp.shard], buf[sp.block])
                else:
                    self.comm.gather(src[sp.shard], buf[sp.block] if keep else None, root=0)
            if keep:
                for i in u.params:
                    o, n = self.layout.offsets[i] - u.lo, self.layout.numels[i]
                    out[self.names[i]] = buf[o:o + n].view(self.params[i].shape).clone()
        return out

    @contextlib.contextmanager
    def gathered(self, params: Iterable[nn.Parameter], modifier_rank: int | None = None):
        """Full parameters inside the block; on exit changes are written back to the
        shards (from `modifier_rank` if given, else each rank's own copy) and the
        parameters released. Collective: every rank must enter."""
        units = list(dict.fromkeys(self.unit_of[id(p)] for p in params if id(p) in self.unit_of))
        if self.resident:  # the parameters are the shard: edits reach the master only
            try:
                yield
            finally:
                st = self.state
                for u in units:
                    if modifier_rank is not None:
                        self.dp.broadcast(u.full, root=modifier_rank)
                    if st.master is not None:
                        keep_changes(u.full, st.master[u.lo:u.hi])
            return
        for u in units:
            self._gather(u)
            self._wait(u)
        try:
            yield
        finally:
            st = self.state
            if self.secondary is not None:
                self.secondary.invalidate()
            for u in units:
                if modifier_rank is not None:
                    self.dp.broadcast(u.full, root=modifier_rank)
                for sp in self.layout.spans(st.own, u.blocks, u.lo):
                    new, old = u.full[sp.mine], st.shard_param[sp.shard]
                    if st.master is not None:  # keep fp32 precision where the value did not change
                        keep_changes(new, st.master[sp.shard], old)
                    old.copy_(new)
                self._release(u)

    def materialized(self) -> list[str]:
        """Names of non-persistent parameters gathered now (full storage besides the
        shard); resident units are the shard itself: none."""
        if self.resident:
            return []
        return [self.names[i] for u in self.units if not u.persistent
                for i in u.params if self.params[i].untyped_storage().nbytes() > 0]

    def memory_extra(self) -> dict[str, int]:
        """persistent: the always-gathered unit; gathered: units gathered now (pool slots
        lent, a slot may be larger than its unit, plus fallbacks); gather_pool: the pool's
        fixed slots, lent or not; gather_fallbacks: how many times a gather found no free
        slot and allocated a fresh buffer (a count, not bytes); secondary: the node-local
        copies of zero.stage3.secondary_partition."""
        pool = self.pool
        if self.resident:  # views of the shard: no memory of their own
            return {"persistent": 0, "secondary": 0, "gathered": 0, "gather_pool": 0, "gather_fallbacks": 0}
        return {"persistent": sum(flat.nbytes(u.full) for u in self.units if u.persistent),
                "secondary": self.secondary.nbytes if self.secondary is not None else 0,
                "gathered": sum(u.full.untyped_storage().nbytes() for u in self.units if not u.persistent),
                "gather_pool": pool.nbytes if pool is not None else 0,
                "gather_fallbacks": pool.fallbacks if pool is not None else 0}

