"""PartitionedParams (stage 3): between uses every rank holds only its shard.

- Units. Each module's own trainable parameters (recurse=False) form a unit, laid out
  on whole blocks of the flat space so one unit is gathered with one all-gather per
  block and nothing of its neighbours. Parameters of at most
  `stage3.persistence_threshold` elements form one persistent unit that stays gathered
  (refreshed after each update).
- Gather/release. Every unit owns a flat buffer of its full size; the parameters are
  permanent views of it. Releasing resizes the buffer's *storage* to zero bytes and
  gathering resizes it back and fills it, so tensors autograd saved for backward
  (often views such as weight.t()) neither pin freed memory nor go stale, and touching
  a released parameter fails loudly instead of reading garbage.
    forward pre-hook  -> gather the module's units (prefetched ones just wait)
    forward post-hook -> release them; hook the outputs so that backward gathers again
    a unit's last gradient accumulated -> release it (gradients go through the
    per-bucket reduce-scatter of grads.py into the gradient shard)
- Order. The first step records the order of gathers (forward and backward) and checks
  it is the same on every rank with one tiny all-reduce per gather, so a rank that runs
  a different module raises an error naming it instead of deadlocking. Later steps
  prefetch the next `stage3.prefetch_modules` units along the recorded order, within
  `stage3.max_live_parameters` gathered elements.
"""
from __future__ import annotations

import contextlib
from typing import Iterable

import torch
import torch.nn as nn

from . import flat
from .params import Plan


class _Unit:
    def __init__(self, idx: int, name: str, params: list[int], blocks: range, span: tuple[int, int],
                 persistent: bool):
        self.idx, self.name, self.params, self.blocks = idx, name, params, blocks
        self.lo, self.hi = span
        self.persistent = persistent
        self.full: torch.Tensor | None = None
        self.state = "free"  # free | inflight | ready
        self.handles: list = []
        self.pending = 0     # parameters whose gradient has not accumulated yet

    @property
    def size(self) -> int:
        return self.hi - self.lo


def _free(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(0)


def _alloc(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(t.numel() * t.element_size())


class PartitionedParams:
    """Stage 3: only shards between uses; units gathered just in time (see above)."""

    @staticmethod
    def plan(model: nn.Module, trainable: list, cfg) -> Plan:
        thr = cfg.stage3.persistence_threshold
        names = {id(p): n for n, p in trainable}
        seen: set[int] = set()
        units: list[tuple[str, list]] = []
        persistent: list = []
        module_params: dict[nn.Module, list[int]] = {}
        for mname, mod in model.named_modules():
            own = []
            for p in mod.parameters(recurse=False):
                if id(p) not in names:
                    continue
                module_params.setdefault(mod, []).append(id(p))
                if id(p) in seen:
                    continue  # tied: belongs to the unit of the module that registered it first
                seen.add(id(p))
                (persistent if p.numel() <= thr else own).append((names[id(p)], p))
            if own:
                units.append((mname or "<root>", own))
        units.reverse()  # backward order: the last module's gradients arrive first
        if persistent:
            units.append(("<persistent>", persistent))
        return Plan(order=[np for _, ps in units for np in ps], unit_sizes=[len(ps) for _, ps in units],
                    unit_names=[u[0] for u in units],
                    unit_persistent=[u[0] == "<persistent>" for u in units], module_params=module_params)

    def __init__(self, plan: Plan, params: list, names: list[str], layout, state, comm, cfg,
                 owns_all: bool = False):
        self.params, self.names, self.layout, self.state, self.comm = params, names, layout, state, comm
        self.cfg = cfg.stage3
        self.module_params = plan.module_params
        self.units: list[_Unit] = []
        self.unit_of: dict[int, _Unit] = {}
        pl, dtype = state.placement, state.param_dtype
        for u, (blocks, span, pidx) in enumerate(zip(layout.unit_blocks, layout.unit_spans, layout.unit_params)):
            unit = _Unit(u, plan.unit_names[u], list(pidx), blocks, span, plan.unit_persistent[u])
            # Identical start everywhere, one unit at a time: values come from the
            # partitioned construction (zerompi.Init) or from rank 0's full tensors.
            full32 = pl.zeros(unit.size, torch.float32)
            from_rank0 = False
            for i in unit.params:
                p = params[i]
                o, n = layout.offsets[i] - unit.lo, layout.numels[i]
                piece = getattr(p, "_zero_init", None)
                if piece is not None:
                    if piece.world != comm.size:
                        raise ValueError(f"parameter {names[i]} was built under zerompi.Init over "
                                         f"{piece.world} ranks, but the engine's data-parallel group "
                                         f"has {comm.size}: pass the same dims to Init and initialize")
                    full32[o:o + n].copy_(piece.gather().reshape(-1))
                    del p._zero_init
                else:
                    full32[o:o + n].copy_(p.detach().reshape(-1))
                    from_rank0 = True
            if from_rank0:
                comm.broadcast(full32, root=0)
            state.set_full(full32, blocks=blocks, base=unit.lo)
            unit.full = full32 if dtype == torch.float32 else pl.empty(unit.size, dtype).copy_(full32)
            del full32
            for i in unit.params:
                o, n = layout.offsets[i] - unit.lo, layout.numels[i]
                params[i].data = unit.full[o:o + n].view(params[i].shape)
                self.unit_of[id(params[i])] = unit
            if unit.persistent:
                unit.state = "ready"
            else:
                _free(unit.full)
            self.units.append(unit)
        self._live = 0  # gathered elements of non-persistent units
        self._fwd_trace: list[int] | None = None
        self._bwd_trace: list[int] | None = None
        self._recording: list[int] | None = None
        self._phase = "idle"
        self._cursor = 0
        self._hooks = []
        for mod, pids in self.module_params.items():
            units = list(dict.fromkeys(self.unit_of[i] for i in pids))
            self._hooks.append(mod.register_forward_pre_hook(self._pre_forward(units)))
            self._hooks.append(mod.register_forward_hook(self._post_forward(units)))
        for p in params:
            self._hooks.append(p.register_post_accumulate_grad_hook(self._grad_done(self.unit_of[id(p)])))

    # ------------------------------------------------------------------ phases (engine calls)
    # On an exception in forward/backward nothing below runs: waiting on in-flight
    # gathers could block on peers that will never match them (see ZeroEngine.backward).
    def start_forward(self) -> None:
        self._phase, self._cursor = "forward", 0
        if self._fwd_trace is None and torch.is_grad_enabled():
            self._recording = []

    def finish_forward(self) -> None:
        if self._fwd_trace is None and self._recording is not None:
            self._fwd_trace, self._recording = self._recording, None
        self._release_all()  # prefetched but unused units, and anything left gathered
        self._phase = "idle"

    def start_backward(self) -> None:
        self._phase, self._cursor = "backward", 0
        for u in self.units:
            u.pending = len(u.params)
        if self._bwd_trace is None:
            self._recording = []

    def finish_backward(self) -> None:
        if self._bwd_trace is None:
            self._bwd_trace, self._recording = self._recording, None
        self._release_all()
        self._phase = "idle"

    def after_update(self) -> None:
        """Only persistent units are kept gathered: refresh them from the new shards."""
        for u in self.units:
            if u.persistent:
                u.state = "free"
                self._gather(u)
                self._wait(u)

    # ------------------------------------------------------------------ gather / release
    def _gather(self, u: _Unit) -> None:
        if u.state != "free":
            return
        _alloc(u.full)
        shard = self.state.shard_param
        u.handles = [self.comm.all_gather(shard[sp.shard], u.full[sp.block], async_op=True)
                     for sp in self.layout.spans(self.state.own, u.blocks, u.lo)]
        u.state = "inflight"
        if not u.persistent:
            self._live += u.size

    def _wait(self, u: _Unit) -> None:
        if u.state == "inflight":
            for h in u.handles:
                h.wait()
            u.handles = []
            u.state = "ready"

    def _release(self, u: _Unit) -> None:
        if u.persistent or u.state == "free":
            return
        self._wait(u)
        _free(u.full)
        u.state = "free"
        self._live -= u.size

    def _release_all(self) -> None:
        for u in self.units:
            self._release(u)

    def _fetch(self, units: Iterable[_Unit], where: str) -> None:
        for u in units:
            if self._recording is not None and not u.persistent:
                self._check_same_unit(u, where)
                self._recording.append(u.idx)
            self._gather(u)
            self._wait(u)
            self._prefetch_after(u)

    def _check_same_unit(self, u: _Unit, where: str) -> None:
        hi, neg_lo = self.comm.allreduce_scalars([float(u.idx), float(-u.idx)], op="max")
        if hi != -neg_lo:
            names = self.comm.allgather_object(u.name)
            raise RuntimeError(f"stage 3: ranks run different modules in the first step's {where} "
                               f"(" + ", ".join(f"rank {r}: {n}" for r, n in enumerate(names)) +
                               "); every rank must call the same modules in the same order")

    def _prefetch_after(self, u: _Unit) -> None:
        trace = self._fwd_trace if self._phase == "forward" else self._bwd_trace
        n = self.cfg.prefetch_modules
        if not trace or n == 0:
            return
        try:
            pos = trace.index(u.idx, self._cursor)
        except ValueError:
            return
        self._cursor = pos + 1
        for nxt in trace[pos + 1:pos + 1 + n]:
            v = self.units[nxt]
            if v.state == "free" and self._live + v.size <= self.cfg.max_live_parameters:
                self._gather(v)  # async: completes when the module asks for it

    # ------------------------------------------------------------------ hooks
    def _pre_forward(self, units: list[_Unit]):
        def hook(mod, args):
            self._fetch(units, "forward")
        return hook

    def _post_forward(self, units: list[_Unit]):
        def hook(mod, args, output):
            for u in units:
                self._release(u)
            if torch.is_grad_enabled():
                for t in _tensors(output):
                    if t.requires_grad:
                        t.register_hook(self._pre_backward(units))
        return hook

    def _pre_backward(self, units: list[_Unit]):
        def hook(grad):
            self._fetch(units, "backward")
        return hook

    def _grad_done(self, u: _Unit):
        def hook(p):
            u.pending -= 1
            if u.pending == 0:
                self._release(u)
        return hook

    # ------------------------------------------------------------------ whole-model access
    def full_state(self, all_ranks: bool) -> dict[str, torch.Tensor]:
        """fp32 parameters, streamed unit by unit to rank 0 (every rank with all_ranks):
        other ranks never hold more than one unit's chunk."""
        st, out = self.state, {}
        src = st.master if st.mixed else st.shard_param
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
        for u in units:
            self._gather(u)
            self._wait(u)
        try:
            yield
        finally:
            st = self.state
            for u in units:
                if modifier_rank is not None:
                    self.comm.broadcast(u.full, root=modifier_rank)
                for sp in self.layout.spans(st.own, u.blocks, u.lo):
                    new, old = u.full[sp.mine], st.shard_param[sp.shard]
                    if st.mixed:  # keep fp32 precision where the value did not change
                        m = st.master[sp.shard]
                        changed = new != old
                        m[changed] = new[changed].float()
                    old.copy_(new)
                self._release(u)

    def materialized(self) -> list[str]:
        """Names of non-persistent parameters whose full storage currently exists."""
        return [self.names[i] for u in self.units if not u.persistent
                for i in u.params if self.params[i].untyped_storage().nbytes() > 0]

    def memory_extra(self) -> dict[str, int]:
        return {"persistent": sum(flat.nbytes(u.full) for u in self.units if u.persistent),
                "gathered": sum(u.full.untyped_storage().nbytes() for u in self.units if not u.persistent)}


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o)
