"""Precision policy and loss scaling.

bf16/fp16: the model runs on low-precision parameters; each rank keeps fp32 master
weights for its shard only. fp16 needs dynamic loss scaling: the loss is multiplied by
`scale` before backward, gradients are stored scaled (small values would underflow in
fp16 otherwise) and unscaled inside the optimizer pass. Overflow is decided from the
global gradient norm, which every rank computes from the same all-reduced sum, so all
ranks skip the same steps and keep the same scale.
"""
from __future__ import annotations

import torch

from .config import LossScaleConfig
from .runtime import JobError
from .runtime.console import say

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def reduce_dtype_of(precision: str, reduce_dtype: str) -> torch.dtype:
    """The gradient reduction's dtype (zero.reduce_dtype): fp32, or the parameters' own."""
    return torch.float32 if reduce_dtype == "fp32" else DTYPES[precision]


class Diverged(JobError, FloatingPointError):
    """Training stopped on every rank together: gradients stayed non-finite (or the fp16
    loss scale collapsed). Raised at the same step on every rank (the decision comes
    from the all-reduced norm), so callers may end the job cleanly without MPI_Abort."""

    exit_code = 4


class NonFinitePolicy:
    """What happens when the global gradient norm is inf/nan. The update is skipped on
    every rank; rank 0 logs it with the step every time; after `max_consecutive` skipped
    steps in a row (fp32/bf16: nothing else will ever change) training stops with
    Diverged. fp16 counts on the loss scale instead: overflows lower it, and overflowing
    at fp16.min_scale stops (DynamicLossScaler)."""

    def __init__(self, max_consecutive: int, precision: str, rank: int):
        self.max, self.precision, self.rank = max_consecutive, precision, rank
        self.streak = 0  # non-finite steps in a row; 0 after a finite one

    def record(self, step: int, finite: bool, scale: float, new_scale: float) -> None:
        if finite:
            self.streak = 0
            return
        self.streak += 1
        what = (f"fp16 overflow, loss scale {scale:g} -> {new_scale:g}" if self.precision == "fp16"
                else f"non-finite gradient norm ({self.streak} in a row)")
        say(f"step {step}: {what}: update skipped", rank=self.rank)
        if self.precision != "fp16" and self.max and self.streak >= self.max:
            raise Diverged(f"step {step}: {self.streak} steps in a row with a non-finite loss or gradient "
                           f"({self.precision}): training has diverged (zero.max_nonfinite_steps = "
                           f"{self.max}); its last finite step {step - self.streak} may have produced the "
                           f"bad weights: resume from a checkpoint of step {step - self.streak - 1} or earlier "
                           "(train: --resume_from TAG) with a lower learning rate")


class StaticLossScaler:
    """Scale 1, never skips (fp32 and bf16)."""

    scale = 1.0

    def update(self, overflow: bool) -> None:
        return None

    def state_dict(self) -> dict:
        return {"scale": 1.0}

    def load_state_dict(self, state: dict) -> None:
        return None


class DynamicLossScaler:
    """fp16 loss scale: lowered after `hysteresis` overflows, raised after `window`
    overflow-free steps (which also restores the hysteresis budget)."""

    def __init__(self, cfg: LossScaleConfig):
        self.cfg = cfg
        self.scale = float(cfg.initial_scale)
        self.good_steps = 0
        self.hysteresis_left = cfg.hysteresis

    def update(self, overflow: bool) -> None:
        cfg = self.cfg
        if overflow:
            self.good_steps = 0
            if self.hysteresis_left > 1:
                self.hysteresis_left -= 1
                return
            if self.scale <= cfg.min_scale:
                raise Diverged(
                    f"fp16 gradients overflow (inf/nan) at the minimum loss scale "
                    f"fp16.min_scale={cfg.min_scale}: training has diverged")
            self.scale = max(self.scale / cfg.factor, cfg.min_scale)
            return
        self.good_steps += 1
        if self.good_steps % cfg.window == 0:
            self.scale *= cfg.factor
            self.hysteresis_left = cfg.hysteresis

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps,
                "hysteresis_left": self.hysteresis_left}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.good_steps = int(state.get("good_steps", 0))
        self.hysteresis_left = int(state.get("hysteresis_left", self.cfg.hysteresis))


def make_scaler(precision: str, cfg: LossScaleConfig):
    return DynamicLossScaler(cfg) if precision == "fp16" else StaticLossScaler()


def cast_inputs(obj, dtype: torch.dtype):
    """Cast floating-point tensors in (nested) args to the compute dtype."""
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() and obj.dtype != dtype else obj
    if isinstance(obj, (list, tuple)):
        return type(obj)(cast_inputs(o, dtype) for o in obj)
    if isinstance(obj, dict):
        return {k: cast_inputs(v, dtype) for k, v in obj.items()}
    return obj
