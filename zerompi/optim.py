"""Partitioned AdamW over flat fp32 shards.

The rank's shard is cut into segments, each inside one partition chunk and one
parameter group. The math mirrors torch.optim.AdamW (single-tensor path) op for op, so
with identical gradients the update is bitwise identical to torch on CPU. GPU shards
use the fused kernel in zerompi/kernels (same arithmetic, plus the cast to bf16/fp16).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import torch
import torch.nn as nn

from .config import OptimizerConfig

GROUP_KEYS = ("lr", "betas", "eps", "weight_decay")


@dataclass
class Segment:
    """One contiguous run of the shard: views into the buffers the step touches."""

    master: torch.Tensor     # fp32 weights, updated in place
    grad: torch.Tensor       # stored gradient (any float dtype, possibly scaled)
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    param: int               # index of the parameter this piece belongs to
    param_lo: int            # first element of that parameter held here
    group: int
    lowp: torch.Tensor | None = None  # low-precision copy to refresh (bf16/fp16 runs)


def build_groups(model: nn.Module, defaults: OptimizerConfig,
                 param_groups: Sequence[dict] | None) -> tuple[list[dict], dict[int, int]]:
    """torch-style param groups -> (group hyper-parameters, id(param) -> group index).

    Parameters not named in any group fall into group 0 with the config defaults."""
    base = {"lr": defaults.lr, "betas": tuple(defaults.betas), "eps": defaults.eps,
            "weight_decay": defaults.weight_decay}
    groups, owner = [dict(base)], {}
    known = {id(p) for p in model.parameters()}
    for gi, g in enumerate(param_groups or ()):
        if "params" not in g:
            raise ValueError(f"param_groups[{gi}]: missing 'params'")
        bad = set(g) - set(GROUP_KEYS) - {"params", "name"}
        if bad:
            raise ValueError(f"param_groups[{gi}]: unknown keys {sorted(bad)} (valid: {GROUP_KEYS})")
        hp = dict(base)
        hp.update({k: g[k] for k in GROUP_KEYS if k in g})
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


class ShardedAdamW:
    """AdamW on the segments of this rank's shard. `param_groups` is mutable (LR schedules).

    As torch.optim.AdamW, a parameter that got no gradient in a step (on any rank) is
    left alone: no weight decay, no moment decay, and its own step count (which drives
    bias correction) does not advance."""

    def __init__(self, segments: Iterable[Segment], param_groups: list[dict], num_params: int):
        self.segments = list(segments)
        self.param_groups = param_groups
        self.steps = [0] * num_params

    def step(self, grad_coef: float = 1.0, used: Sequence[bool] | None = None) -> None:
        """One update; gradients are multiplied by `grad_coef` (unscale x clip) first;
        parameters with used[i] False are skipped."""
        for i in range(len(self.steps)):
            if used is None or used[i]:
                self.steps[i] += 1
        for s in self.segments:
            if used is not None and not used[s.param]:
                continue
            hp = self.param_groups[s.group]
            lr, (beta1, beta2), eps, wd = hp["lr"], hp["betas"], hp["eps"], hp["weight_decay"]
            step = self.steps[s.param]
            g = s.grad
            if grad_coef != 1.0 or g.dtype != torch.float32:
                g = g.float().mul_(grad_coef) if g.dtype != torch.float32 else g.mul(grad_coef)
            p = s.master
            if wd != 0:
                p.mul_(1 - lr * wd)
            s.exp_avg.lerp_(g, 1 - beta1)
            s.exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            bias_correction1 = 1 - beta1 ** step
            bias_correction2 = 1 - beta2 ** step
            step_size = lr / bias_correction1
            denom = (s.exp_avg_sq.sqrt() / bias_correction2 ** 0.5).add_(eps)
            p.addcdiv_(s.exp_avg, denom, value=-step_size)
            if s.lowp is not None:
                s.lowp.copy_(p)

    def state_dict(self) -> dict:
        return {"steps": list(self.steps),
                "param_groups": [dict(g, betas=list(g["betas"])) for g in self.param_groups]}

    def load_state_dict(self, state: dict) -> None:
        self.steps = [int(s) for s in state["steps"]]
        for g, saved in zip(self.param_groups, state["param_groups"]):
            g.update({k: (tuple(v) if k == "betas" else v) for k, v in saved.items()})
