"""ShardState: the one owner of a rank's model-state memory, and where it lives.

Every buffer of model state is allocated here, through one Placement (host memory or a
CUDA device, device.py), so moving training to a GPU or offloading to the host changes
the placement, not the call sites. Which buffers exist is decided by three flags the
engine derives from the stage (zero/engine.py, PARTS):

  buffer        elements            exists when                     dtype
  flat_param    layout.total        replicated parameters (0-2)     param dtype
  shard_param   owned               partitioned parameters (3)      param dtype
  master        owned               bf16/fp16 (fp32: the parameters are the master)   fp32
  exp_avg(_sq)  owned               always                          fp32
  flat_grad     layout.total        full gradients (0-1)            grad dtype
  grad_shard    owned               partitioned gradients (2-3)     grad dtype
  host_grad     owned               offload_optimizer = cpu         fp32

With the optimizer offloaded (ZeRO-Offload), master, exp_avg(_sq) and host_grad live in
host memory (pinned when the model is on a GPU) and the master exists in fp32 too (the
device parameters are then its working copy): the update runs on the host and writes
each segment back to the device. The staged pipeline (staging > 0, zero/offload.py)
has no fp32 host_grad: `staging` pairs of host buffers, (gradient in its own dtype,
parameter-dtype output), page-locked on a GPU (zero/pinned.py), and the master and
moments in plain pages (nothing copies them to or from the device).

`owned` = the elements of this rank's chunks (stage 0: every element, shard index =
flat index). The optimizer reads and writes these through segment views (views()).
"""
from __future__ import annotations

from typing import Sequence

import torch

from ..device import Placement
from .flat import gather_chunks, nbytes
from .partition import Chunk, FlatLayout


class ShardState:
    def __init__(self, layout: FlatLayout, own: Sequence[Chunk], placement: Placement,
                 param_dtype: torch.dtype, grad_dtype: torch.dtype, *, replicated: bool,
                 full_grads: bool, offload: bool = False, staging: int = 0):
        self.layout, self.own, self.placement = layout, list(own), placement
        self.offload = offload
        # where the optimizer's state lives: the device, or host memory (pinned for the copy
        # pipeline's async copies; the staged one copies through its staging buffers only)
        self.opt_placement = (Placement(torch.device("cpu"), pinned=placement.is_cuda and not staging)
                              if offload else placement)
        self.param_dtype, self.grad_dtype = param_dtype, grad_dtype
        self.mixed = param_dtype != torch.float32
        self.replicated = replicated
        self.owned = owned = sum(c.size for c in self.own)
        z = placement.zeros
        self.flat_param = z(layout.total, param_dtype) if replicated else None
        self.shard_param = None if replicated else z(owned, param_dtype)
        zo = self.opt_placement.zeros
        self.master = zo(owned, torch.float32) if self.mixed or offload else None
        self.exp_avg = zo(owned, torch.float32)
        self.exp_avg_sq = zo(owned, torch.float32)
        self.flat_grad = z(layout.total, grad_dtype) if full_grads else None
        self.grad_shard = None if full_grads else z(owned, grad_dtype)
        self.host_grad = zo(owned, torch.float32) if offload and not staging else None
        self.staging = []  # [(gradient, output)] host staging of the staged pipeline
        if offload and staging:
            from .pinned import host_zeros

            pin = placement.is_cuda
            self.staging = [(host_zeros(owned, grad_dtype, pin), host_zeros(owned, param_dtype, pin))
                            for _ in range(staging)]

    # ------------------------------------------------------------ initial values
    def set_full(self, full32: torch.Tensor, blocks=None, base: int = 0) -> None:
        """Initial parameter values from fp32 flat values (of `blocks`, starting at flat
        offset `base`; default everything): into the owned shard, the master, and -
        replicated - the whole flat_param."""
        if self.replicated:
            if full32 is not self.flat_param:
                self.flat_param[base:base + full32.numel()].copy_(full32)
        else:
            gather_chunks(full32, self.layout, self.own, self.shard_param, blocks, base)
        if self.master is not None:
            gather_chunks(full32, self.layout, self.own, self.master, blocks, base)

    def scratch_full32(self) -> torch.Tensor:
        """A zeroed fp32 flat buffer for the initial values: flat_param itself when it
        is fp32 and replicated (no second copy of the model), else a temporary."""
        if self.replicated and not self.mixed:
            return self.flat_param
        return self.placement.zeros(self.layout.total, torch.float32)

    # ------------------------------------------------------------ views for the optimizer
    def param_piece(self, shard_lo: int, flat_lo: int, n: int) -> torch.Tensor:
        """The working (param-dtype) values of an owned piece."""
        if self.replicated:
            return self.flat_param[flat_lo:flat_lo + n]
        return self.shard_param[shard_lo:shard_lo + n]

    def views(self, shard_lo: int, flat_lo: int, n: int):
        """(fp32 master, stored gradient, exp_avg, exp_avg_sq, low-precision copy or None)
        of the owned piece at shard [shard_lo, +n), flat [flat_lo, +n)."""
        work = self.param_piece(shard_lo, flat_lo, n)
        sh = slice(shard_lo, shard_lo + n)
        if self.host_grad is not None:  # host master and gradient copy; the device piece is the working copy
            return self.master[sh], self.host_grad[sh], self.exp_avg[sh], self.exp_avg_sq[sh], work
        # (staged offload: the host master, the gradient where backward left it, the working copy)
        master = self.master[sh] if self.master is not None else work
        grad = self.grad_shard[sh] if self.grad_shard is not None else self.flat_grad[flat_lo:flat_lo + n]
        return master, grad, self.exp_avg[sh], self.exp_avg_sq[sh], (work if self.mixed or self.offload else None)

    def offload_grads(self) -> None:
        """Offload: the reduced gradient of the owned elements -> host_grad (fp32), before
        the host reads its norm and updates. One copy per owned span (the whole grad shard
        at stages 2-3); the copy into pageable or pinned memory completes before return."""
        if self.grad_shard is not None:
            self.host_grad.copy_(self.grad_shard)
        else:
            gather_chunks(self.flat_grad, self.layout, self.own, self.host_grad)

    def grad_shard_fp32(self) -> torch.Tensor:
        if self.grad_shard is not None:
            return self.grad_shard.float()
        out = self.placement.empty(self.owned, torch.float32)
        gather_chunks(self.flat_grad.float(), self.layout, self.own, out)
        return out

    def zero_grads(self) -> None:
        (self.flat_grad if self.flat_grad is not None else self.grad_shard).zero_()

    # ------------------------------------------------------------ accounting
    def memory_report(self) -> dict[str, int]:
        """Bytes of model states by category (the paper's Psi terms)."""
        rep = {"params": nbytes(self.flat_param) + nbytes(self.shard_param),
               "grads": nbytes(self.flat_grad) + nbytes(self.grad_shard),
               "master": nbytes(self.master),
               "optimizer": nbytes(self.exp_avg) + nbytes(self.exp_avg_sq)}
        staged = sum(nbytes(t) for pair in self.staging for t in pair)
        rep["grads"] += nbytes(self.host_grad) + sum(nbytes(g) for g, _ in self.staging)
        rep["params"] += sum(nbytes(o) for _, o in self.staging)
        rep["model_states"] = rep["params"] + rep["grads"] + rep["master"] + rep["optimizer"]
        # of which in host memory because the optimizer is offloaded
        rep["offloaded"] = (nbytes(self.master) + nbytes(self.exp_avg) + nbytes(self.exp_avg_sq)
                            + nbytes(self.host_grad) + staged) if self.offload else 0
        return rep

    def buffers(self) -> dict[str, torch.Tensor]:
        """Every buffer this state allocated (for placement checks)."""
        names = ("flat_param", "shard_param", "master", "exp_avg", "exp_avg_sq", "flat_grad", "grad_shard",
                 "host_grad")
        out = {n: getattr(self, n) for n in names if getattr(self, n) is not None}
        for k, (g, o) in enumerate(self.staging):
            out[f"staging_grad{k}"], out[f"staging_out{k}"] = g, o
        return out
