"""The trainer's learning-rate schedules (TrainConfig.lr_schedule).

cosine (the default): at step s, linear warm-up lr (s + 1) / warmup_steps, then cosine
from lr down to min_lr, reached at lr_decay_steps (0: max_steps) and kept after.

deepspeed_warmup / deepspeed_warmup_decay / deepspeed_warmup_cosine: DeepSpeed's WarmupLR /
WarmupDecayLR / WarmupCosineLR, as `--deepspeed_config` maps them (zerompi.initialize builds
the same from optim/ds_schedules.py). DeepSpeed steps its scheduler after each applied
optimizer update and not after a skipped one (fp16 overflow), so update k (counted from 0)
uses the schedule at position i = k - 1; `position` gives the trainer that count
(engine.global_steps) for these. With W = warmup_steps (>= 2), a = warmup_start_lr,
peak = lr, T = lr_decay_steps or max_steps, g(i) = i / W (warmup_type linear) or
log(i + 1) / log(W) (log):
  deepspeed_warmup:        i < 0: a;  then a + (peak - a) (g(i) if i < W else 1)
  deepspeed_warmup_decay:  as deepspeed_warmup, but after W: a + (peak - a) max(0, (T - i) / max(1, T - W))
  deepspeed_warmup_cosine: i < 0: 0;  i < W: a + (peak - a) g(i);  then
                           max(0, min_lr + (peak - min_lr)(1 + cos(pi p)) / 2),
                           p = min(1, (i - W + 1) / max(1, T - W))
(DeepSpeed's own ratios: a = warmup_min_ratio x lr, min_lr = cos_min_ratio x lr.)
"""
from __future__ import annotations

import math

KINDS = ("cosine", "deepspeed_warmup", "deepspeed_warmup_decay", "deepspeed_warmup_cosine")


def position(cfg, step: int, updates: int) -> int:
    """Where the schedule stands at loop step `step` after `updates` applied updates."""
    return step if cfg.lr_schedule == "cosine" else updates


def lr_at(pos: int, cfg) -> float:
    peak, warmup, kind = cfg.zero.optimizer.lr, cfg.warmup_steps, cfg.lr_schedule
    end = cfg.lr_decay_steps or cfg.max_steps
    if kind == "cosine":
        if pos < warmup:
            return peak * (pos + 1) / warmup
        if pos >= end:
            return cfg.min_lr
        frac = (pos - warmup) / max(1, end - warmup)
        return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * frac)) * (peak - cfg.min_lr)
    if kind not in KINDS:
        raise ValueError(f"lr_schedule {kind!r}: one of {', '.join(KINDS)}")
    i, start = pos - 1, cfg.warmup_start_lr
    g = (i / warmup if cfg.warmup_type == "linear" else math.log(i + 1) / math.log(warmup)) if i >= 0 else 0.0
    if kind in ("deepspeed_warmup", "deepspeed_warmup_decay"):
        if i < 0:
            return start
        if i >= warmup:
            g = 1.0 if kind == "deepspeed_warmup" else max(0.0, float(end - i) / float(max(1, end - warmup)))
        return start + (peak - start) * g
    if i < 0:
        return 0.0
    if i < warmup:
        return start + (peak - start) * g
    p = min(1.0, (i - warmup + 1) / max(1, end - warmup))
    return max(0.0, cfg.min_lr + (peak - cfg.min_lr) * 0.5 * (1.0 + math.cos(math.pi * p)))
