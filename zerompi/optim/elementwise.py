"""torch's SGD and Adagrad over the shard's segment table.

Both updates are elementwise (each element's new value depends on that element's
parameter, gradient and state only), so updating each rank's shard gives exactly the
update of the whole tensor: they partition as AdamW does. The ops mirror torch's
single-tensor paths (torch.optim.sgd / adagrad, foreach=False) op for op, on each
segment's views, after the engine's reduction, unscaling and clipping (grad_coef).

Their state lives in ShardState's two moment buffers, so the engine's checkpoints save
and load it at full shapes, at any world size and stage, like AdamW's:
  SGD      momentum_buffer -> exp_avg  (torch starts it as a copy of the first gradient:
                                        here at each parameter's first counted step)
  Adagrad  state sum       -> exp_avg_sq (starts at initial_accumulator_value)
A checkpoint records the groups' keys, so one optimizer's checkpoint is refused by
another's engine (ShardOptimizer.load_hyper_state).
"""
from __future__ import annotations

from typing import Sequence

import torch

from .adamw import KEYS_OF
from .base import ShardOptimizer


class _Elementwise(ShardOptimizer):
    def step(self, grad_coef: float | None = None, used: Sequence[bool] | None = None) -> None:
        """One update (engine.step() calls it); parameters with used[i] False are skipped,
        as torch skips parameters without a gradient."""
        grad_coef = self._engine_call(grad_coef)
        self._count_steps(used)
        for s, (p, g, a, b, lowp) in zip(self.segments, self._views):
            if used is not None and not used[s.param]:
                continue
            g = g.float().mul_(grad_coef) if g.dtype != torch.float32 else (
                g if grad_coef == 1.0 else g.mul(grad_coef))
            self._update(p, g, a, b, self.groups[s.group], self.steps[s.param])
            if lowp is not None:
                lowp.copy_(p)


class ShardSGD(_Elementwise):
    """torch.optim.SGD (momentum, dampening, nesterov, weight decay)."""

    KIND = "sgd"
    HYPER = KEYS_OF["sgd"]

    @staticmethod
    def _update(p, g, buf, _, hp, step) -> None:
        lr, mom, damp, wd = hp["lr"], hp["momentum"], hp["dampening"], hp["weight_decay"]
        if wd != 0:
            g = g.add(p, alpha=wd)
        if mom != 0:
            if step == 1:
                buf.copy_(g)  # torch: torch.clone(grad) when there is no buffer yet
            else:
                buf.mul_(mom).add_(g, alpha=1 - damp)
            g = g.add(buf, alpha=mom) if hp["nesterov"] else buf
        p.add_(g, alpha=-lr)


class ShardAdagrad(_Elementwise):
    """torch.optim.Adagrad (lr_decay, weight decay, initial_accumulator_value, eps)."""

    KIND = "adagrad"
    HYPER = KEYS_OF["adagrad"]

    @staticmethod
    def _update(p, g, _, state_sum, hp, step) -> None:
        if step == 1:
            state_sum.fill_(hp["initial_accumulator_value"])
        if hp["weight_decay"] != 0:
            g = g.add(p, alpha=hp["weight_decay"])
        clr = hp["lr"] / (1 + (step - 1) * hp["lr_decay"])
        state_sum.addcmul_(g, g, value=1)
        std = state_sum.sqrt().add_(hp["eps"])
        p.addcdiv_(g, std, value=-clr)


KINDS = {"sgd": ShardSGD, "adagrad": ShardAdagrad}
