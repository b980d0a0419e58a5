"""DeepSpeed's learning-rate schedulers, written out as the reference the DeepSpeed-config
tests compare against (tests/unit/test_ds_train.py, tests/system/test_train_deepspeed.py)."""
import math


class DeepSpeedScheduler:
    """DeepSpeed's WarmupLR / WarmupCosineLR as DeepSpeed drives them: the lr is set once
    when the scheduler is built (iteration -1) and after every applied update (step())."""

    def __init__(self, kind, lr, **p):
        self.kind, self.lr0, self.p, self.it = kind, lr, p, -1
        self.lr = self._lr()

    def step(self):
        self.it += 1
        self.lr = self._lr()

    def _lr(self):
        p, i, w = self.p, self.it, max(2, self.p.get("warmup_num_steps", 1000))
        if self.kind == "WarmupLR":
            lo, hi = p.get("warmup_min_lr", 0.0), p.get("warmup_max_lr", self.lr0)
            return lo if i < 0 else lo + (hi - lo) * (i / w if i < w else 1.0)
        if i < 0:
            return 0.0
        if i < w:
            return self.lr0 * (p.get("warmup_min_ratio", 0.0) + i / w * (1 - p.get("warmup_min_ratio", 0.0)))
        low = p.get("cos_min_ratio", 1e-4)
        progress = min(1.0, (i - w + 1) / max(1, p["total_num_steps"] - w))
        return self.lr0 * max(0.0, low + (1 - low) * (1 + math.cos(math.pi * progress)) / 2)
