"""ZeRO stage 3: between uses every rank holds only its shard of each parameter.

Units. Each module's own trainable parameters (recurse=False) form a unit, laid out on
whole blocks of the flat space so one unit is gathered with one all-gather per block
and nothing of its neighbours. Parameters of at most `stage3.persistence_threshold`
elements form one persistent unit that stays gathered (refreshed after each update).

Gather/release. Every unit owns a flat buffer of its full size; the parameters are
permanent views of it. Releasing resizes the buffer's *storage* to zero bytes and
gathering resizes it back and fills it, so tensors autograd saved for backward (often
views such as weight.t()) neither pin freed memory nor go stale, and touching a
released parameter fails loudly instead of reading garbage.
  forward pre-hook  -> gather the module's units (prefetched ones just wait)
  forward post-hook -> release them; hook the outputs so that backward gathers again
  a unit's last gradient accumulated -> release it; gradients go through the same
  bucketed reduce-scatter as stage 2 (grads.py) into the gradient shard.

Order. The first step records the order of gathers (forward and backward) and checks
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
from .engine import ZeroEngine, _unique_params


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


class Stage3Engine(ZeroEngine):
    """ZeroEngine with partitioned parameters (config stage = 3)."""

    # ------------------------------------------------------------------ layout
    def _layout_order(self, model: nn.Module, trainable: list):
        thr = self.config.stage3.persistence_threshold
        ids = {id(p) for _, p in trainable}
        names = {id(p): n for n, p in trainable}
        seen: set[int] = set()
        units: list[tuple[str, list]] = []
        persistent: list = []
        self._module_params: dict[nn.Module, list[int]] = {}  # module -> id(param) it uses
        for mname, mod in model.named_modules():
            own = []
            for p in mod.parameters(recurse=False):
                if id(p) not in ids:
                    continue
                self._module_params.setdefault(mod, []).append(id(p))
                if id(p) in seen:
                    continue  # tied: belongs to the unit of the module that registered it first
                seen.add(id(p))
                (persistent if p.numel() <= thr else own).append((names[id(p)], p))
            if own:
                units.append((mname or "<root>", own))
        units.reverse()  # backward order: the last module's gradients arrive first
        if persistent:
            units.append(("<persistent>", persistent))
        self._unit_names = [u[0] for u in units]
        self._unit_persistent = [u[0] == "<persistent>" for u in units]
        order = [np for _, ps in units for np in ps]
        return order, [len(ps) for _, ps in units]

    # ------------------------------------------------------------------ storage
    def _init_storage(self, model: nn.Module, owned: int) -> None:
        lay = self.layout
        self.flat_param = self.flat_grad = None
        self.shard_param = torch.zeros(owned, dtype=self.dtype)
        self.master = torch.zeros(owned, dtype=torch.float32) if self.mixed else None
        grad_dtype = torch.float32 if self.config.grad_accum_dtype == "fp32" else self.dtype
        self.grad_shard = torch.zeros(owned, dtype=grad_dtype)
        self.units: list[_Unit] = []
        self._unit_of: dict[int, _Unit] = {}
        self._own_by_block = own_by_block = {c.block: c for c in self.own}
        for u, (blocks, span, params) in enumerate(zip(lay.unit_blocks, lay.unit_spans, lay.unit_params)):
            unit = _Unit(u, self._unit_names[u], list(params), blocks, span, self._unit_persistent[u])
            # Identical start everywhere, one unit at a time: values come from the
            # partitioned construction (zerompi.Init) or from rank 0's full tensors.
            full32 = torch.zeros(unit.size, dtype=torch.float32)
            from_rank0 = False
            for i in unit.params:
                p = self.params[i]
                o, n = lay.offsets[i] - unit.lo, lay.numels[i]
                if hasattr(p, "_zero_init"):
                    full32[o:o + n].copy_(p._zero_init.gather(self.comm).reshape(-1))
                    del p._zero_init
                else:
                    full32[o:o + n].copy_(p.detach().reshape(-1))
                    from_rank0 = True
            if from_rank0:
                self.comm.broadcast(full32, root=0)
            for k in blocks:
                c = own_by_block[k]
                src = full32[c.flat_lo - unit.lo:c.flat_hi - unit.lo]
                self.shard_param[c.shard_lo:c.shard_lo + c.size].copy_(src)
                if self.mixed:
                    self.master[c.shard_lo:c.shard_lo + c.size].copy_(src)
            unit.full = full32.to(self.dtype) if self.mixed else full32
            del full32
            for i in unit.params:
                o, n = lay.offsets[i] - unit.lo, lay.numels[i]
                self.params[i].data = unit.full[o:o + n].view(self.params[i].shape)
                self._unit_of[id(self.params[i])] = unit
            if unit.persistent:
                unit.state = "ready"
            else:
                _free(unit.full)
            self.units.append(unit)
        self._sync_untracked(model, {id(p) for p in self.params})
        self._live = sum(u.size for u in self.units if u.state != "free" and not u.persistent)
        self._fwd_trace: list[int] | None = None
        self._bwd_trace: list[int] | None = None
        self._recording: list[int] | None = None
        self._phase = "idle"
        self._cursor = 0
        self._hooks = []
        for mod, pids in self._module_params.items():
            units = list(dict.fromkeys(self._unit_of[i] for i in pids))
            if units:
                self._hooks.append(mod.register_forward_pre_hook(self._pre_forward(units)))
                self._hooks.append(mod.register_forward_hook(self._post_forward(units)))
        for p in self.params:
            self._hooks.append(p.register_post_accumulate_grad_hook(self._grad_done(self._unit_of[id(p)])))

    def _segment_views(self, lo: int, hi: int, a: int, b: int):
        master = self.master[a:b] if self.mixed else self.shard_param[a:b]
        return master, self.grad_shard[a:b], (self.shard_param[a:b] if self.mixed else None)

    def _after_update(self) -> None:
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
        own = self._own_by_block
        u.handles = []
        for k in u.blocks:
            c = own[k]
            s, e = self.layout.blocks[k]
            u.handles.append(self.comm.all_gather(self.shard_param[c.shard_lo:c.shard_lo + c.size],
                                                  u.full[s - u.lo:e - u.lo], async_op=True))
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
        n = self.config.stage3.prefetch_modules
        if not trace or n == 0:
            return
        try:
            pos = trace.index(u.idx, self._cursor)
        except ValueError:
            return
        self._cursor = pos + 1
        budget = self.config.stage3.max_live_parameters
        for nxt in trace[pos + 1:pos + 1 + n]:
            v = self.units[nxt]
            if v.state == "free" and self._live + v.size <= budget:
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

    # ------------------------------------------------------------------ training API
    def __call__(self, *args, **kwargs):
        self._phase, self._cursor = "forward", 0
        record = self._fwd_trace is None and torch.is_grad_enabled()
        if record:
            self._recording = []
        # On an exception nothing below runs: waiting on in-flight gathers could block on
        # peers that will never match them (see ZeroEngine.backward).
        out = super().__call__(*args, **kwargs)
        if record:
            self._fwd_trace, self._recording = self._recording, None
        self._release_all()  # prefetched but unused units, and anything left gathered
        self._phase = "idle"
        return out

    def backward(self, loss: torch.Tensor) -> None:
        self._phase, self._cursor = "backward", 0
        for u in self.units:
            u.pending = len(u.params)
        record = self._bwd_trace is None
        if record:
            self._recording = []
        super().backward(loss)
        if record:
            self._bwd_trace, self._recording = self._recording, None
        self._release_all()
        self._phase = "idle"

    # ------------------------------------------------------------------ introspection
    def full_state_dict(self, all_ranks: bool = False) -> dict[str, torch.Tensor]:
        """fp32 parameters, streamed unit by unit to rank 0 (every rank with all_ranks):
        other ranks never hold more than one unit's chunk."""
        out = {}
        src = self.master if self.mixed else self.shard_param
        for u in self.units:
            buf = torch.empty(u.size, dtype=torch.float32) if (all_ranks or self.rank == 0) else None
            own = self._own_by_block
            for k in u.blocks:
                c = own[k]
                s, e = self.layout.blocks[k]
                chunk = src[c.shard_lo:c.shard_lo + c.size]
                if all_ranks:
                    self.comm.all_gather(chunk, buf[s - u.lo:e - u.lo])
                else:
                    self.comm.gather(chunk, buf[s - u.lo:e - u.lo] if buf is not None else None, root=0)
            if buf is not None:
                for i in u.params:
                    o, n = self.layout.offsets[i] - u.lo, self.layout.numels[i]
                    out[self.param_names[i]] = buf[o:o + n].view(self.params[i].shape).clone()
        if not (all_ranks or self.rank == 0):
            return {}
        tracked = set(out)
        result = {}
        for name, p in _unique_params(self.module):
            result[name] = out[name] if name in tracked else p.detach().float().clone()
        return result

    def memory_report(self) -> dict[str, int]:
        rep = {
            "params": flat.nbytes(self.shard_param),
            "grads": flat.nbytes(self.grad_shard),
            "master": flat.nbytes(self.master),
            "optimizer": flat.nbytes(self.exp_avg) + flat.nbytes(self.exp_avg_sq),
            "buffers": self.reducer.buffer_bytes(),
            "persistent": sum(flat.nbytes(u.full) for u in self.units if u.persistent),
            "gathered": sum(u.full.untyped_storage().nbytes() for u in self.units if not u.persistent),
            "loose_grads": sum(flat.nbytes(p.grad) for p in self.params if p.grad is not None),
        }
        rep["model_states"] = rep["params"] + rep["grads"] + rep["master"] + rep["optimizer"]
        rep["numel"] = sum(self.layout.numels)
        rep["padded_numel"] = self.layout.total
        return rep

    def materialized_params(self) -> list[str]:
        """Names of non-persistent parameters whose full storage currently exists."""
        return [self.param_names[i] for u in self.units if not u.persistent
                for i in u.params if self.params[i].untyped_storage().nbytes() > 0]

    # ------------------------------------------------------------------ temporary full access
    @contextlib.contextmanager
    def gathered(self, params: Iterable[nn.Parameter], modifier_rank: int | None = None):
        """Full parameters inside the block; on exit changes are written back to the
        shards (from `modifier_rank` if given, else each rank's own copy) and the
        parameters released. Collective: every rank must enter."""
        units = list(dict.fromkeys(self._unit_of[id(p)] for p in params if id(p) in self._unit_of))
        for u in units:
            self._gather(u)
            self._wait(u)
        try:
            yield
        finally:
            own = self._own_by_block
            for u in units:
                if modifier_rank is not None:
                    self.comm.broadcast(u.full, root=modifier_rank)
                for k in u.blocks:
                    c = own[k]
                    new = u.full[c.flat_lo - u.lo:c.flat_hi - u.lo]
                    old = self.shard_param[c.shard_lo:c.shard_lo + c.size]
                    if self.mixed:  # keep fp32 precision where the value did not change
                        m = self.master[c.shard_lo:c.shard_lo + c.size]
                        changed = new != old
                        m[changed] = new[changed].float()
                    old.copy_(new)
                self._release(u)


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o)
