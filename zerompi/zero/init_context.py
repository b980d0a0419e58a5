"""Partitioned construction (`zerompi.Init`) and temporary full access
(`zerompi.GatheredParameters`) for stage 3.

Inside `Init`, each parameter is cut into N equal pieces the moment a module registers
it: the rank keeps its piece (fp32) and the parameter keeps its shape over an empty
storage, so at most one full parameter exists at a time and no rank ever holds the
whole model. torch.nn.init functions are redirected while Init is active: they fill a
temporary full tensor (consuming the random stream exactly as without Init) and keep
this rank's piece, so a model built with the same seed has the same values with and
without Init. Any other in-place write to a partitioned parameter fails loudly (the
storage is empty); use GatheredParameters for those. All ranks seed the same generator
on entry (`seed`, default config.seed), since every rank computes the same full values.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Iterable

import torch
import torch.nn as nn

from .. import config as config_mod
from .. import runtime

_INIT_FUNCS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_",
               "dirac_", "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_",
               "orthogonal_", "sparse_")


class _PieceOf:
    """This rank's piece of one parameter built under Init (the engine takes it over).
    It keeps the group it was partitioned over, so gathering it needs no other grid."""

    def __init__(self, full: torch.Tensor, comm):
        self.comm, rank, world = comm, comm.rank, comm.size
        self.numel, self.shape, self.rank, self.world = full.numel(), full.shape, rank, world
        self.chunk = -(-self.numel // world)
        self.piece = torch.zeros(self.chunk, dtype=torch.float32)
        self.keep(full)

    def keep(self, full: torch.Tensor) -> None:
        """Keep this rank's piece of the full values."""
        flat = full.detach().reshape(-1).float()
        seg = flat[self.rank * self.chunk:(self.rank + 1) * self.chunk]
        self.piece.zero_()
        self.piece[:seg.numel()].copy_(seg)

    def gather(self) -> torch.Tensor:
        buf = torch.empty(self.chunk * self.world, dtype=torch.float32)
        self.comm.all_gather(self.piece, buf)
        return buf[:self.numel].view(self.shape)


def _empty_storage(p: torch.Tensor) -> None:
    t = torch.empty(p.shape, dtype=p.dtype)
    t.untyped_storage().resize_(0)
    p.data = t


class Init:
    """`with zerompi.Init(config): model = Build()` builds `model` partitioned."""

    def __init__(self, config=None, dims=None, seed: int | None = None):
        self.config = config_mod.load(config)
        if dims is None:
            from ..parallel import ParallelDims
            dims = ParallelDims.from_config(self.config)
        self.dims = dims
        self.comm = dims.dp  # parameters are partitioned over the data-parallel group
        self.seed = self.config.seed if seed is None else seed
        self._saved: dict[str, object] = {}
        self._handle = None

    def _partition(self, module: nn.Module, name: str, param):
        if param is None or hasattr(param, "_zero_init") or not isinstance(param, nn.Parameter):
            return None
        param._zero_init = _PieceOf(param.detach(), self.comm)
        _empty_storage(param)
        return None

    def _wrap(self, fn):
        @functools.wraps(fn)
        def wrapped(tensor, *args, **kwargs):
            piece = getattr(tensor, "_zero_init", None)
            if piece is None:
                return fn(tensor, *args, **kwargs)
            tmp = torch.empty(piece.shape, dtype=tensor.dtype)
            with torch.no_grad():
                fn(tmp, *args, **kwargs)
            piece.keep(tmp)
            return tensor
        return wrapped

    def __enter__(self) -> "Init":
        torch.manual_seed(self.seed)  # same full values on every rank
        for f in _INIT_FUNCS:
            orig = getattr(nn.init, f, None)
            if orig is not None:
                self._saved[f] = orig
                setattr(nn.init, f, self._wrap(orig))
        self._handle = nn.modules.module.register_module_parameter_registration_hook(self._partition)
        return self

    def __exit__(self, *exc) -> None:
        self._handle.remove()
        for f, orig in self._saved.items():
            setattr(nn.init, f, orig)
        self._saved.clear()
        runtime.release_free_memory()  # the freed full parameters, see runtime.py


@contextlib.contextmanager
def GatheredParameters(params: Iterable[nn.Parameter] | nn.Module, engine=None,
                       modifier_rank: int | None = None):
    """Full values of `params` inside the block, written back to the shards on exit.

    Works on an engine's parameters (pass `engine`; stages 0-2 hold them full already)
    and on parameters still held by Init (each remembers the data-parallel group Init
    partitioned it over). With `modifier_rank` (a rank of that group), that rank's
    values are broadcast before the write-back. Collective: every rank of the group
    must enter."""
    if isinstance(params, nn.Module):
        params = list(params.parameters())
    params = list(params)
    if engine is not None:
        with engine.gathered(params, modifier_rank=modifier_rank):
            yield
        return
    held = [p for p in params if hasattr(p, "_zero_init")]
    for p in held:
        p.data = p._zero_init.gather().to(p.dtype).clone()
    try:
        yield
    finally:
        for p in held:
            if modifier_rank is not None:
                t = p.data.float().contiguous()
                p._zero_init.comm.broadcast(t, root=modifier_rank)
                p._zero_init.keep(t)
            else:
                p._zero_init.keep(p.data)
            _empty_storage(p)
