"""Parameter stores: where the working (low-precision) parameters live between uses.

ReplicatedParams (stages 0-2, here): every rank holds every parameter, as views of the
ShardState's flat_param; after an update each rank's new chunks are all-gathered.
PartitionedParams (stage 3, stage3/store.py): only shards between uses, units gathered
just in time.

Both stores answer the same calls, so the engine never asks which one it has: plan(),
start/finish_forward(), start/finish_backward(), after_update(), full_state(),
gathered(), materialized(), memory_extra(), explain(), and `serve` (called while the
reducer waits; None when there is nothing to serve).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterable

import torch
import torch.nn as nn

from . import flat
from .init_context import adopt


@dataclass
class Plan:
    """Flat-buffer order of the trainable parameters and how they group into units."""

    order: list                         # [(name, param)] in flat-buffer order
    unit_sizes: list[int] | None = None  # parameters per unit (None: one unit)
    unit_names: list[str] = field(default_factory=list)
    unit_persistent: list[bool] = field(default_factory=list)
    unit_roots: list = field(default_factory=list)  # the modules whose forward gathers each unit (tuple; None: persistent)
    model: nn.Module | None = None       # stage 3: names modules in error messages


def sync_untracked(model: nn.Module, tracked: set[int], comm, dtype: torch.dtype, buffers: str = "keep") -> None:
    """Broadcast frozen parameters and buffers from rank 0; cast frozen floating parameters
    to the compute dtype and floating buffers as zero.buffer_dtype says (keep: their own
    dtype, as DeepSpeed since 0.19.2; fp32; param: the compute dtype)."""
    to = {"keep": None, "fp32": torch.float32, "param": dtype}[buffers]
    for p in model.parameters():
        if id(p) not in tracked:
            # frozen, built under zerompi.Init: full values first (all ranks, same order)
            t = adopt(p) if hasattr(p, "_zero_init") else p.detach().float().contiguous()
            comm.broadcast(t, root=0)
            p.data = t.to(dtype)
    for mod in model.modules():
        for _, b in mod.named_buffers(recurse=False):
            if b is None:
                continue
            t = b.detach().contiguous()
            comm.broadcast(t, root=0)
            b.data = t.to(to) if t.is_floating_point() and to is not None else t


def keep_changes(new: torch.Tensor, master: torch.Tensor, old: torch.Tensor | None = None) -> None:
    """Edits made under GatheredParameters reach the fp32 master: elements whose working
    value changed (vs `old`, default the master rounded) take it; the others keep fp32
    precision. The master may be in host memory (offloaded optimizer)."""
    m = master.to(new.device)
    changed = new != (m.to(new.dtype) if old is None else old)
    m[changed] = new[changed].float()
    if m is not master:
        master.copy_(m)


class ReplicatedParams:
    """Stages 0-2: full parameters on every rank (views of state.flat_param)."""

    @staticmethod
    def plan(model: nn.Module, trainable: list, cfg, coalesce_below: int = 0) -> Plan:
        # Backward order: the last registered parameter usually gets its gradient first.
        return Plan(order=trainable[::-1])

    def __init__(self, plan: Plan, params: list, names: list[str], layout, state, comm, cfg,
                 owns_all: bool, groups=None):
        # comm: the shard group (gathers); dp: every data-parallel rank (rank 0's values)
        self.params, self.names, self.layout, self.state, self.comm = params, names, layout, state, comm
        self.dp = groups.dp if groups is not None else comm
        self.owns_all = owns_all
        for p in params:  # built under zerompi.Init: assemble the full values first
            if hasattr(p, "_zero_init"):
                p.data = adopt(p).to(p.dtype)
        full32 = state.scratch_full32()
        flat.pack_into(full32, params, layout)
        self.dp.broadcast(full32, root=0)  # identical start everywhere: rank 0's values
        state.set_full(full32)
        del full32
        flat.bind_params(params, state.flat_param, layout)

    def start_forward(self) -> None:
        pass

    def finish_forward(self) -> None:
        pass

    def start_backward(self) -> None:
        pass

    def finish_backward(self) -> None:
        pass

    serve = None  # no gathers during forward/backward: the reducer may simply block

    def explain(self, exc: BaseException) -> None:
        """Parameters are never released here: no error of ours to explain."""
        return None

    def after_update(self) -> None:
        """Every rank's working parameters from the owners' updated chunks (alone: the
        update wrote them all)."""
        if self.owns_all or self.comm.size == 1:
            return
        fp = self.state.flat_param
        handles = [self.comm.all_gather(fp[sp.mine], fp[sp.block], async_op=True)
                   for sp in self.layout.spans(self.state.own)]
        for h in handles:
            h.wait()

    def full_state(self, all_ranks: bool) -> dict[str, torch.Tensor]:
        st = self.state
        if self.owns_all or not st.mixed:
            full = (st.master if st.mixed else st.flat_param).float()
        else:
            gathered = st.placement.empty(self.comm.size * self.layout.shard_size, torch.float32)
            self.comm.all_gather(st.master.to(gathered.device), gathered)  # offloaded: host master
            full = flat.unshard(gathered.view(self.comm.size, -1), self.layout)
        if not (all_ranks or self.comm.rank == 0):
            return {}
        return {n: full[o:o + k].view(p.shape).clone() for n, p, o, k in
                zip(self.names, self.params, self.layout.offsets, self.layout.numels)}

    @contextlib.contextmanager
    def gathered(self, params: Iterable[nn.Parameter], modifier_rank: int | None = None):
        """Parameters are full on every rank already. On exit, `modifier_rank`'s values
        are broadcast, and edits reach the fp32 master of the owned pieces (elements whose
        working value no longer equals the master's), so the next update starts from them
        instead of silently undoing them. Collective: every rank must enter."""
        mine = {id(p) for p in self.params}
        params = [p for p in params if id(p) in mine]
        yield
        if modifier_rank is not None:
            for p in params:  # contiguous views of flat_param
                self.dp.broadcast(p.data, root=modifier_rank)
        st = self.state
        if st.master is not None:  # else (fp32, on the device) flat_param is the master itself
            for sp in self.layout.spans(st.own):
                keep_changes(st.flat_param[sp.mine], st.master[sp.shard])

    def materialized(self) -> list[str]:
        return list(self.names)

    def memory_extra(self) -> dict[str, int]:
        return {}
