"""ShardedAdamW's update on the host through torch's fused CPU AdamW kernel.

Why: with the optimizer offloaded (ZeRO-Offload) the host update is the step's time.
ShardedAdamW's per-segment torch ops make about ten passes over the shard's memory, two
of them allocating temporaries. torch._fused_adamw_ (the kernel behind
torch.optim.AdamW(fused=True) on the CPU) reads and writes each element once, vectorised
and multi-threaded (the measured difference: docs/performance.md, "Offload host pass").

Not bitwise torch's single-tensor path (the fused arithmetic rounds differently, within a
few ulps per step), which is why the engine uses it only for the offloaded optimizer on a
GPU (where nothing is bitwise torch anyway) and when asked for (implementation = fused).
"""
from __future__ import annotations

from functools import lru_cache
from typing import Sequence

import torch

from .adamw import ShardedAdamW


@lru_cache(maxsize=1)
def available() -> bool:
    """Whether this torch has the fused AdamW kernel for CPU tensors (2.4 on; 2.3, which
    setup.py allows, has it for CUDA only): asked once, on one element."""
    if not hasattr(torch, "_fused_adamw_"):
        return False
    one = [torch.zeros(1) for _ in range(4)]
    try:
        torch._fused_adamw_([one[0]], [one[1]], [one[2]], [one[3]], [], [torch.ones(())], lr=0.0,
                            beta1=0.9, beta2=0.9, weight_decay=0.0, eps=1e-8, amsgrad=False,
                            maximize=False)
    except (RuntimeError, NotImplementedError):
        return False
    return True


class HostFusedAdamW(ShardedAdamW):
    """ShardedAdamW whose step is one torch._fused_adamw_ call per (parameter group,
    step count) over the segments' host views; gradients must be fp32 (the offloaded
    optimizer's host_grad is). Bookkeeping, views, norms and state_dict are the base's."""

    def __init__(self, segments, views, param_groups: list[dict], num_params: int):
        super().__init__(segments, views, param_groups, num_params)
        for s, (p, g, _, _, _) in zip(self.segments, self._views):
            if p.device.type != "cpu" or g.dtype != p.dtype:
                raise ValueError(f"HostFusedAdamW: parameter {s.param} has a {g.dtype} gradient on "
                                 f"{g.device} for a {p.dtype} master on {p.device}; it updates host "
                                 "fp32 shards (the offloaded optimizer's)")

    def step(self, grad_coef: float | None = None, used: Sequence[bool] | None = None) -> None:
        """As ShardedAdamW.step. The gradients are divided in place by 1/grad_coef (the
        kernel's grad_scale): they are the host copy, rewritten before every update."""
        grad_coef = self._engine_call(grad_coef)
        self._count_steps(used)
        batches: dict[tuple[int, int], list] = {}
        for s, v in zip(self.segments, self._views):
            if used is None or used[s.param]:
                batches.setdefault((s.group, self.steps[s.param]), []).append(v)
        scale = None if grad_coef == 1.0 else torch.tensor(1.0 / grad_coef, dtype=torch.float32)
        for (group, step), views in batches.items():
            hp = self.groups[group]
            beta1, beta2 = hp["betas"]
            count = torch.tensor(float(step))  # read, not advanced, by the kernel
            torch._fused_adamw_([v[0] for v in views], [v[1] for v in views], [v[2] for v in views],
                                [v[3] for v in views], [], [count] * len(views),
                                lr=float(hp["lr"]), beta1=float(beta1), beta2=float(beta2),
                                weight_decay=float(hp["weight_decay"]), eps=float(hp["eps"]),
                                amsgrad=False, maximize=False, grad_scale=scale, found_inf=None)
            for p, _, _, _, lowp in views:
                if lowp is not None:
                    lowp.copy_(p)
