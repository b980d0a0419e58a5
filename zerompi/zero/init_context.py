"""Partitioned construction (`zerompi.Init`), temporary full access
(`zerompi.GatheredParameters`) and the hand-over to the engine (`adopt`).

Inside `Init`, every parameter a module registers becomes a ZeroInitParameter
(init_param.py): it stays full while its module's construction is likely to touch it,
then keeps only this rank's 1/N piece; any later op inside the block brings it back
(one all-gather, or nothing when the op overwrites it), so initialisation of any kind
gives bitwise the weights of the same code without Init, and at most `keep_full`
parameters are full at a time on any rank. Outside the block a partitioned parameter
answers metadata queries only; other ops raise an error naming it.

All ranks seed the same generator on entry (`seed`, default config.seed), since every
rank computes the same full values: `torch.manual_seed(s); Build()` and
`with Init(cfg, seed=s): Build()` give the same weights and leave the same RNG state.
"""
from __future__ import annotations

import contextlib
import weakref
import zlib
from collections import OrderedDict
from typing import Iterable

import torch
import torch.nn as nn

from .. import config as config_mod
from .. import runtime
from . import init_param as ip
from .init_param import InitRecord, ZeroInitParameter  # noqa: F401  (re-exported)


class Session:
    """One open Init block: the LRU of full parameters, module names, the op log."""

    def __init__(self, comm, keep_full: int, timeout: float | None):
        self.comm, self.keep_full, self.timeout = comm, keep_full, timeout
        self.lru: OrderedDict[int, ZeroInitParameter] = OrderedDict()
        self.ops: list[str] = []      # "number:op", for naming a divergence
        self.index: dict = {}         # id(record) -> (number, record)
        self.crc = 0
        self.peak_full, self.peak_elems, self.gathers = 0, 0, 0
        self.busy: set[int] = set()   # arguments of the op being run: never evicted under it

    # -------------------------------------------------------------- registration hooks
    def on_param(self, module: nn.Module, name: str, p):
        # meta parameters hold no values to partition (transformers' from_pretrained builds
        # on meta, then puts loaded tensors in place past the hooks: they stay plain)
        if p is None or isinstance(p, ZeroInitParameter) or p.device.type == "meta":
            return None
        ip.track(p, self.comm, module, name)
        self.added(p)
        return None

    def on_module(self, parent: nn.Module, name: str, child):
        if child is not None and child not in ip.PARENT:  # registered twice: first name
            ip.PARENT[child] = (weakref.ref(parent), name)
        return None

    # -------------------------------------------------------------- the LRU of full ones
    def added(self, p: ZeroInitParameter) -> None:
        self.lru[id(p)] = p
        self.shrink()

    def touch(self, p: ZeroInitParameter) -> None:
        if id(p) in self.lru:
            self.lru.move_to_end(id(p))

    def bring(self, p: ZeroInitParameter, overwrite: bool, op: str) -> None:
        """Make a partitioned parameter full for `op` and cache it."""
        ip.materialize(p, overwrite=overwrite, timeout=self.timeout)
        self.gathers += not overwrite
        self.added(p)

    def shrink(self) -> None:
        while len(self.lru) > self.keep_full:
            victim = next((k for k, q in self.lru.items()
                           if k not in self.busy and q._zero_init.pinned == 0 and ip.evictable(q)),
                          None)
            if victim is None:
                break
            ip.partition(self.lru.pop(victim))
        self.peak_full = max(self.peak_full, len(self.lru))
        self.peak_elems = max(self.peak_elems, sum(q.numel() for q in self.lru.values()))

    def log(self, held: list, func) -> None:
        # parameters numbered by first appearance in this block: the same on every rank
        keys = [self.index.setdefault(id(q._zero_init), (len(self.index), q._zero_init))[0] for q in held]
        entry = ",".join(map(str, keys)) + ":" + ip.op_name(func)
        self.ops.append(entry)
        self.crc = zlib.crc32(entry.encode(), self.crc)

    # -------------------------------------------------------------- exit
    def close(self) -> None:
        """Partition what is left full (no communication). Parameters that bypassed the
        registration hook (a plain module built before the block and attached inside it,
        a direct `_parameters[...] =`) stay plain: the engine then starts them from rank
        0's values, which is right even if the ranks' values differ."""
        for p in self.lru.values():
            if p._zero_init.pinned == 0:
                ip.partition(p)
        self.lru.clear()

    @staticmethod
    def _say(entry: str, index: dict) -> str:
        ids, op = entry.split(":", 1)
        recs = {k: r for k, r in index.values()}
        return f"`{op}` on " + ", ".join(recs[int(i)].describe() if int(i) in recs else f"parameter #{i}"
                                         for i in ids.split(","))

    def check_same_everywhere(self) -> None:
        """Ranks that touched parameters differently (or drew different random numbers)
        hold a mix of models: name the first difference. One small allgather."""
        if self.comm.size == 1:
            self.index, self.ops = {}, []
            return
        rng = zlib.crc32(torch.get_rng_state().numpy().tobytes())
        mine = (len(self.ops), self.crc, rng)
        everyone = self.comm.allgather_object(mine)
        logs = self.comm.allgather_object(self.ops) if any(e != everyone[0] for e in everyone) else None
        index, self.index, self.ops = self.index, {}, []  # release the records' pieces
        if logs is None:
            return
        k = next((i for i in range(max(map(len, logs))) if len({tuple(lg[i:i + 1]) for lg in logs}) > 1),
                 None)
        if k is None:
            raise RuntimeError("zerompi.Init: ranks drew different random numbers while building the "
                               "model; seed every rank the same (zerompi.Init(seed=...))")
        ops = "; ".join(f"rank {r}: {self._say(lg[k], index) if k < len(lg) else '(nothing)'}"
                        for r, lg in enumerate(logs))
        raise RuntimeError(f"zerompi.Init: ranks built the model differently at parameter op #{k} "
                           f"({ops}); code under Init must touch parameters identically on every rank")


class Init:
    """`with zerompi.Init(config): model = Build()` builds `model` partitioned.

    keep_full: parameters kept full at a time (the LRU of recently touched ones; an op
      on more parameters than that holds its arguments full while it runs).
    timeout: seconds a gather of one parameter waits for the other ranks before failing
    with its name (ranks running different construction code); None waits forever."""

    def __init__(self, config=None, dims=None, seed: int | None = None, keep_full: int = 8,
                 timeout: float | None = 300.0):
        self.config = config_mod.load(config)
        if dims is None:
            from ..parallel import ParallelDims
            dims = ParallelDims.from_config(self.config)
        self.dims = dims
        self.comm = dims.dp  # parameters are partitioned over the data-parallel group
        self.seed = self.config.seed if seed is None else seed
        if keep_full < 1:
            raise ValueError(f"zerompi.Init: keep_full must be >= 1, got {keep_full}")
        self.keep_full, self.timeout = keep_full, timeout
        self.session: Session | None = None
        self._handles: list = []

    def __enter__(self) -> "Init":
        if ip.ACTIVE:  # nested (a Build() that opens its own Init): the outer block rules
            self.session, self._handles = ip.ACTIVE[-1], None
            return self
        torch.manual_seed(self.seed)  # same full values on every rank
        s = self.session = Session(self.comm, self.keep_full, self.timeout)
        reg = nn.modules.module
        self._handles = [reg.register_module_parameter_registration_hook(s.on_param),
                         reg.register_module_module_registration_hook(s.on_module)]
        ip.ACTIVE.append(s)
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if self._handles is None:
            return
        for h in self._handles:
            h.remove()
        s = self.session
        ip.ACTIVE.remove(s)
        s.close()
        runtime.release_free_memory()  # the freed full parameters, see runtime/malloc.py
        if exc_type is None:  # after an error, peers may never reach this collective
            s.check_same_everywhere()

    def stats(self) -> dict:
        """Peak full parameters/elements held at once and gathers issued (for tests)."""
        s = self.session
        return {"peak_full": s.peak_full, "peak_elements": s.peak_elems, "gathers": s.gathers}


def adopt(p: nn.Parameter) -> torch.Tensor:
    """Take over a parameter built under Init: return its full fp32 values (collective
    over its group while it is partitioned), and leave `p` a plain nn.Parameter over an
    empty storage, with no `_zero_init` marker, for the engine to re-point."""
    rec = getattr(p, "_zero_init", None)
    if rec is None:
        raise ValueError("zerompi init_context.adopt: the parameter was not built under zerompi.Init")
    if rec.pinned:
        raise RuntimeError(f"zerompi init_context.adopt: {rec.describe()} is inside an open "
                           "GatheredParameters block")
    full = rec.gather()
    for s in ip.ACTIVE:
        s.lru.pop(id(p), None)
    shape, dtype, device = p.shape, p.dtype, p.device
    del p._zero_init  # ZeroInitParameter.__delattr__ makes it a plain Parameter again
    with torch.no_grad():
        p.data = ip.placeholder(shape, dtype, device)
    return full


@contextlib.contextmanager
def GatheredParameters(params: Iterable[nn.Parameter] | nn.Module, engine=None,
                       modifier_rank: int | None = None):
    """Full values of `params` inside the block, written back to the shards on exit.

    Works on an engine's parameters (pass `engine`; stages 0-2 hold them full already)
    and on parameters still held by Init (each remembers the data-parallel group Init
    partitioned it over), inside or after the Init block. With `modifier_rank` (a rank
    of that group), that rank's values are broadcast before the write-back. Collective:
    every rank of the group must enter."""
    if isinstance(params, nn.Module):
        params = list(params.parameters())
    params = list(params)
    if engine is not None:
        with engine.gathered(params, modifier_rank=modifier_rank):
            yield
        return
    held = [p for p in dict.fromkeys(params) if isinstance(p, ZeroInitParameter)]
    for p in held:
        rec = p._zero_init
        if rec.full:
            for s in ip.ACTIVE:  # pinned: no LRU may partition it inside the block
                s.lru.pop(id(p), None)
        else:
            ip.materialize(p)
        rec.pinned += 1
    try:
        yield
    finally:
        for p in held:
            rec = p._zero_init
            rec.pinned -= 1
            if rec.pinned:
                continue
            if modifier_rank is not None:
                t = ip.raw(p).detach().contiguous()
                rec.comm.broadcast(t, root=modifier_rank)
                if t.data_ptr() != ip.raw(p).data_ptr():
                    ip.raw(p).copy_(t)
            ip.partition(p)
