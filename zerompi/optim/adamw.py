"""Partitioned AdamW over a segment table of the rank's shard.

The shard is described by a table of segments (build_segments): each is one run of
elements inside one partition chunk, one parameter and one parameter group, given by
offsets, not tensors. Whoever owns the memory (zero/state.py ShardState) turns a
segment into views, so the same table drives this host implementation and, later, one
fused device launch over the whole shard (the table becomes offset/length/group/step
arrays; zerompi/kernels/adamw.py). The host math mirrors torch.optim.AdamW
(single-tensor path) op for op, so with identical gradients the update is bitwise
identical to torch on CPU.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn as nn

from ..config import OptimizerConfig
from .base import ShardOptimizer

GROUP_KEYS = ("lr", "betas", "eps", "weight_decay")
# the group keys of each optimizer.type (torch's names)
KEYS_OF = {"adamw": GROUP_KEYS, "sgd": ("lr", "momentum", "dampening", "nesterov", "weight_decay"),
           "adagrad": ("lr", "lr_decay", "weight_decay", "initial_accumulator_value", "eps")}


@dataclass(frozen=True)
class Segment:
    """One row of the segment table: `length` elements of parameter `param` from its
    element `param_lo`, at `shard_lo` in shard-indexed buffers and `flat_lo` in the
    flat index space, updated with parameter group `group`'s hyper-parameters."""

    shard_lo: int
    flat_lo: int
    length: int
    param: int
    param_lo: int
    group: int


def build_segments(layout, own, group_of: Sequence[int]) -> list[Segment]:
    """The table for the chunks `own` of `layout`; padding never gets a segment."""
    table = []
    for sp in layout.spans(own):
        ch = sp.chunk
        for pc in layout.pieces(ch.flat_lo, ch.flat_hi):
            table.append(Segment(ch.shard_lo + pc.flat_lo - ch.flat_lo, pc.flat_lo, pc.size,
                                 pc.index, pc.param_lo, group_of[pc.index]))
    return table


def build_groups(model: nn.Module, defaults: OptimizerConfig,
                 param_groups: Sequence[dict] | None) -> tuple[list[dict], dict[int, int]]:
    """torch-style param groups -> (group hyper-parameters, id(param) -> group index).

    Parameters not named in any group fall into group 0 with the config defaults. The
    keys are those of the config's optimizer type (KEYS_OF)."""
    keys = KEYS_OF[getattr(defaults, "type", "adamw")]
    base = {k: (tuple(defaults.betas) if k == "betas" else getattr(defaults, k)) for k in keys}
    groups, owner = [dict(base)], {}
    known = {id(p) for p in model.parameters()}
    for gi, g in enumerate(param_groups or ()):
        if "params" not in g:
            raise ValueError(f"param_groups[{gi}]: missing 'params'")
        bad = set(g) - set(keys) - {"params", "name"}
        if bad:
            raise ValueError(f"param_groups[{gi}]: unknown keys {sorted(bad)} (valid: {keys})")
        hp = dict(base)
        hp.update({k: g[k] for k in keys if k in g})
        if "betas" in hp:
            hp["betas"] = tuple(hp["betas"])
        groups.append(hp)
        for p in g["params"]:
            if id(p) not in known:
                raise ValueError(f"param_groups[{gi}]: a parameter that is not in the model")
            if id(p) in owner:
                raise ValueError(f"param_groups[{gi}]: a parameter already in param_groups[{owner[id(p)] - 1}]")
            owner[id(p)] = len(groups) - 1
    return groups, owner


def decay_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """The usual GPT split: decay matrices, no decay on biases and norm weights (ndim < 2)."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


class ShardedAdamW(ShardOptimizer):
    """AdamW over a segment table; `views(seg)` gives (master, grad, exp_avg, exp_avg_sq,
    lowp or None) of a segment (ShardState.views). A torch.optim.Optimizer (base.py):
    each step reads its groups' lr, betas, eps and weight_decay, so schedulers work.

    As torch.optim.AdamW, a parameter that got no gradient in a step (on any rank) is
    left alone: no weight decay, no moment decay, and its own step count (which drives
    bias correction) does not advance."""

    def step(self, grad_coef: float | None = None, used: Sequence[bool] | None = None) -> None:
        """One update (engine.step() calls it); gradients are multiplied by `grad_coef`
        (unscale x clip) first; parameters with used[i] False are skipped."""
        grad_coef = self._engine_call(grad_coef)
        self._count_steps(used)
        for s, (p, g, exp_avg, exp_avg_sq, lowp) in zip(self.segments, self._views):
            if used is not None and not used[s.param]:
                continue
            hp = self.groups[s.group]
            lr, (beta1, beta2), eps, wd = hp["lr"], hp["betas"], hp["eps"], hp["weight_decay"]
            step = self.steps[s.param]
            if grad_coef != 1.0 or g.dtype != torch.float32:
                g = g.float().mul_(grad_coef) if g.dtype != torch.float32 else g.mul(grad_coef)
            if wd != 0:
                p.mul_(1 - lr * wd)
            exp_avg.lerp_(g, 1 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            bias_correction1 = 1 - beta1 ** step
            bias_correction2 = 1 - beta2 ** step
            step_size = lr / bias_correction1
            denom = (exp_avg_sq.sqrt() / bias_correction2 ** 0.5).add_(eps)
            p.addcdiv_(exp_avg, denom, value=-step_size)
            if lowp is not None:
                lowp.copy_(p)
