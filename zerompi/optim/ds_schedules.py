"""DeepSpeed's `scheduler` blocks (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle) as
schedulers over engine.optimizer, with DeepSpeed's semantics (DeepSpeed 0.19's
deepspeed/runtime/lr_schedules.py; tests/unit/test_ds_schedules.py compares them with it):

  the scheduler keeps `last_batch_iteration` i (-1 when built; state_dict holds only it);
  building it sets the lrs for i = -1, and step() advances i and sets them again. The
  engine steps it after every applied update (optim/schedulers.py), as DeepSpeed's engine
  steps the scheduler it built from the config, so update k (from 0) runs at i = k - 1.
  W = max(2, warmup_num_steps); warm-up gamma(i) = i / W (linear) or log(i + 1) / log(W) (log,
  DeepSpeed's default).
  WarmupLR        i < 0: min_lr; then min_lr + (max_lr - min_lr) g, g = gamma(i) for i < W, else 1;
                  warmup_max_lr defaults to the optimizer's lr
  WarmupDecayLR   as WarmupLR, but after W: g = max(0, (T - i) / max(1, T - W)), T = total_num_steps;
                  warmup_max_lr defaults to 0.001 (DeepSpeed's default, not the optimizer's lr)
  WarmupCosineLR  lr = lr0 x ratio, lr0 the group's lr when built; i < 0: 0; i < W:
                  a + (1 - a) gamma(i), a = warmup_min_ratio; then max(0, c + (1 - c)(1 + cos(pi p)) / 2),
                  p = min(1, (i - W + 1) / max(1, T - W)), c = cos_min_ratio (default 1e-4)
  OneCycle        a triangle from cycle_min_lr to cycle_max_lr and back over first (+ second) step
                  sizes, optional stairs, then decay; betas[0] cycled between cycle_max_mom and
                  cycle_min_mom (and betas[1] set to 0.99, as DeepSpeed does) for optimizers with betas
"""
from __future__ import annotations

import math
from typing import Any, Mapping

from ..config.deepspeed.schedules import KINDS, PARAMS
from ..config.errors import ConfigError

class DeepSpeedLR:
    """One of KINDS over `optimizer` (anything with param_groups); `p`: the block's params
    with DeepSpeed's defaults filled in (from_block)."""

    def __init__(self, optimizer, kind: str, p: Mapping[str, Any]):
        self.optimizer, self.kind, self.p = optimizer, kind, dict(p)
        groups = optimizer.param_groups
        self.last_batch_iteration = int(p["last_batch_iteration"])
        self.warmup = max(2, int(p.get("warmup_num_steps") or 2))
        if kind == "WarmupCosineLR":
            self.base = [g["lr"] for g in groups]
        elif kind in ("WarmupLR", "WarmupDecayLR"):
            top = p["warmup_max_lr"]
            self.lo = _per_group(p["warmup_min_lr"], groups)
            self.hi = [g["lr"] for g in groups] if top is None else _per_group(top, groups)
        else:
            first = float(p["cycle_first_step_size"])
            second = first if p["cycle_second_step_size"] is None else float(p["cycle_second_step_size"])
            self.first, self.second, self.total = first, second, first + second
            self.lo, self.hi = _per_group(p["cycle_min_lr"], groups), _per_group(p["cycle_max_lr"], groups)
            self.moms = p["cycle_momentum"] and "betas" in getattr(optimizer, "defaults", {})
            self.mlo, self.mhi = _per_group(p["cycle_min_mom"], groups), _per_group(p["cycle_max_mom"], groups)
        if self.last_batch_iteration == -1:
            self._apply()

    # torch-scheduler-like surface: step(), get_last_lr(), state_dict(), load_state_dict()
    def step(self, last_batch_iteration: int | None = None) -> None:
        self.last_batch_iteration = (self.last_batch_iteration + 1 if last_batch_iteration is None
                                     else int(last_batch_iteration))
        self._apply()

    def get_last_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def state_dict(self) -> dict:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, sd: Mapping) -> None:
        self.last_batch_iteration = int(sd["last_batch_iteration"])

    # ------------------------------------------------------------ formulas
    def _apply(self) -> None:
        groups = self.optimizer.param_groups
        for g, lr in zip(groups, self.lrs()):
            g["lr"] = lr
        if self.kind == "OneCycle" and self.moms:
            for g, m in zip(groups, self.betas0()):
                g["betas"] = (m, 0.99)

    def _gamma(self, i: int) -> float:
        if self.p.get("warmup_type", "log") == "linear":
            return i / self.warmup
        return math.log(i + 1) / math.log(self.warmup)

    def lrs(self) -> list[float]:
        i, k = self.last_batch_iteration, self.kind
        if k in ("WarmupLR", "WarmupDecayLR"):
            if i < 0:
                return list(self.lo)
            if i < self.warmup:
                g = self._gamma(i)
            elif k == "WarmupLR":
                g = 1.0
            else:
                T = self.p["total_num_steps"]
                g = max(0.0, float(T - i) / float(max(1.0, T - self.warmup)))
            return [a + (b - a) * g for a, b in zip(self.lo, self.hi)]
        if k == "WarmupCosineLR":
            if i < 0:
                return [0.0 for _ in self.base]
            if i < self.warmup:
                a = self.p["warmup_min_ratio"]
                r = a + self._gamma(i) * (1.0 - a)
            else:
                c = self.p["cos_min_ratio"]
                prog = min(1.0, (i - self.warmup + 1) / max(1, self.p["total_num_steps"] - self.warmup))
                r = max(0.0, c + (1.0 - c) * (1 + math.cos(math.pi * prog)) / 2)
            return [lr0 * r for lr0 in self.base]
        if i < self.total:
            s = self._scale()
            return [a + (b - a) * s for a, b in zip(self.lo, self.hi)]
        if self._no_decay("decay_lr_rate"):
            return list(self.lo)
        f = 1 + self.p["decay_lr_rate"] * (i - self.total + 1) / self.p["decay_step_size"]
        return [a / f for a in self.lo]

    def betas0(self) -> list[float]:
        i = self.last_batch_iteration
        if i < 0:
            return list(self.mlo)
        if i < self.total:
            s = self._scale()
            return [b - (b - a) * s for a, b in zip(self.mlo, self.mhi)]
        if self._no_decay("decay_mom_rate"):
            return list(self.mhi)
        f = 1 + self.p["decay_mom_rate"] * (i - self.total + 1) / self.p["decay_step_size"]
        return [b * f for b in self.mhi]

    def _no_decay(self, rate: str) -> bool:
        return math.isclose(self.p["decay_step_size"], 0) or math.isclose(self.p[rate], 0)

    def _scale(self) -> float:
        """OneCycle's position in the triangle, 0 -> 1 -> 0 (stairs: held flat in steps)."""
        it = self.last_batch_iteration + 1
        ratio = self.first / self.total
        x = 1.0 + it / self.total - math.floor(1 + it / self.total)
        stairs1 = self.p["cycle_first_stair_count"]
        stairs2 = stairs1 if self.p["cycle_second_stair_count"] is None else self.p["cycle_second_stair_count"]
        s, stairs = (x / ratio, stairs1) if x <= ratio else ((x - 1) / (ratio - 1), stairs2)
        if stairs > 0:
            c = it % self.total
            pos = c * stairs / self.first if c <= self.first else (self.total - c) * stairs / self.second
            s = math.floor(pos) / stairs
        return s


def _per_group(v, groups) -> list:
    if isinstance(v, (list, tuple)):
        if len(v) != len(groups):
            raise ValueError(f"{len(v)} values for {len(groups)} parameter groups")
        return list(v)
    return [v] * len(groups)


def from_block(optimizer, block: Mapping, fill: Mapping[str, Any] | None = None, where: str = "scheduler"):
    """A DeepSpeed config's scheduler block -> DeepSpeedLR over `optimizer`. "auto" values
    take `fill` (the trainer's numbers, by parameter name); without one they are refused,
    as DeepSpeed refuses them (the Hugging Face integration fills them in first)."""
    kind = block.get("type")
    if kind not in KINDS:
        raise ConfigError(f"{where}.type", kind, f"zerompi maps DeepSpeed's {', '.join(KINDS)}"
                          + ("; an lr range test is not a training schedule" if kind == "LRRangeTest" else ""))
    params = dict(block.get("params") or {})
    p = dict(PARAMS[kind])
    for k, v in params.items():
        if k not in p:
            raise ConfigError(f"{where}.params.{k}", v, f"not a parameter of DeepSpeed's {kind} "
                              f"(its parameters: {', '.join(p)})")
        if v == "auto":
            if fill is None or k not in fill:
                raise ConfigError(f"{where}.params.{k}", v, "\"auto\" is filled in by the Hugging Face "
                                  "integration or python -m zerompi.train; zerompi.initialize needs a number")
            v = fill[k]
        p[k] = v
    for k in ("total_num_steps", "cycle_min_lr", "cycle_max_lr"):
        if k in p and p[k] is None:
            raise ConfigError(f"{where}.params.{k}", None, f"DeepSpeed's {kind} needs it")
    if p.get("warmup_type", "log") not in ("log", "linear"):
        p["warmup_type"] = "log"  # DeepSpeed falls back to log for an unknown type (with a warning)
    return DeepSpeedLR(optimizer, kind, p)
