"""The update's gradient coefficient (unscale x clip x 1/contributions) computed where the
gradient norm is, and the host's late read of what it decided.

Why on the device: reading the norm on the host before the update drains the GPU's queue
once per step, so every launch the host makes next (the update, the next forward) starts
from an idle device. Here the coefficient and the overflow flag stay on the device and the
fused AdamW kernel reads them (it skips the update on overflow, as torch's fused AdamW does
with found_inf); the host learns the norm and the overflow a step later (`Pending`), and
only then does its bookkeeping of a skipped step (step counts, counters, the non-finite
policy), before it computes the next update's scalars.

The arithmetic is the host's, in float64 (IEEE sqrt and division on CPU and GPU alike):
    norm = sqrt(sumsq) * unapplied / scale
    coef = unapplied / scale, times float32(clip / (norm + 1e-6)) when that is < 1
(torch.nn.utils.clip_grad_norm_'s rule), rounded to float32 as the kernels' scalars are.
`unapplied` is the 1 / contributions factor no reduction applied (a data-parallel group of
one rank: grads.GradReducer.local), so the stored gradient's norm is scaled by it too.
"""
from __future__ import annotations

import math

import torch


def _formula(s, unapplied: float, scale: float, clip: float, sqrt, div, f32, where):
    """The arithmetic, once, over Python floats (host) or 0-d float64 tensors (device):
    sqrt and div(float, x) must be IEEE (math.sqrt; CUDA's double sqrt; torch's CPU sqrt
    is not, by an ulp; torch's `float / tensor` is a reciprocal times the float). Dividing
    by `scale` is exact either way: a loss scale is a power of two."""
    norm = sqrt(s) * unapplied / scale if unapplied != 1.0 else sqrt(s) / scale
    base = unapplied / scale
    coef = base
    if clip > 0:
        cc = div(clip, norm + 1e-6)
        coef = where(cc < 1.0, f32(cc) * base, base)
    return norm, coef


def coefficient(sumsq: torch.Tensor, scale: float, unapplied: float, clip: float
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 [coef, skip] for the AdamW kernel, float64 [norm, skip, coef] for the
    host), on sumsq's device; sumsq: the global squared norm of the stored gradient (0-d
    float64, +inf or nan on overflow). No host sync (on the CPU there is none to avoid)."""
    s = sumsq.reshape(())
    if s.device.type == "cpu":
        v = float(s)
        skip = not math.isfinite(v)
        norm, coef = _formula(v, unapplied, scale, clip, math.sqrt, lambda a, b: a / b,
                              lambda x: float(torch.tensor(x, dtype=torch.float32)),
                              lambda c, a, b: a if c else b)
        coef = 0.0 if skip else float(torch.tensor(coef, dtype=torch.float32))
        return (torch.tensor([coef, float(skip)], dtype=torch.float32),
                torch.tensor([norm, float(skip), coef], dtype=torch.float64))
    return _on_device(s, scale, unapplied, clip)


def _on_device(s: torch.Tensor, scale: float, unapplied: float, clip: float):
    skip = (~torch.isfinite(s)).to(torch.float64)
    # no tensor is made from a host value (that copy would wait for the device): fills only
    norm, coef = _formula(s, unapplied, scale, clip, torch.sqrt,
                          lambda a, b: torch.div(torch.full_like(b, a), b), lambda x: x.float().double(),
                          lambda c, a, b: torch.where(c, a, torch.full_like(a, b)))
    if not isinstance(coef, torch.Tensor):
        coef = torch.full_like(norm, coef)
    # an overflowed step's coefficient is never used (the kernel skips): keep it finite
    coef = torch.where(skip > 0, torch.zeros_like(coef), coef).float()
    return torch.stack([coef, skip.float()]), torch.stack([norm, skip, coef.double()])


class Pending:
    """The host's view of a step whose decision stayed on the device: a non-blocking copy
    of [norm, skip, coef] into pinned memory and an event after it. read() waits for that
    event only (by then, one step later, long done in practice), never for the stream."""

    def __init__(self, host_vals: torch.Tensor, step: int, used: list[bool] | None):
        self.step, self.used = step, used
        if host_vals.is_cuda:
            self._host = torch.empty(host_vals.shape, dtype=torch.float64, pin_memory=True)
            self._host.copy_(host_vals, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host, self._event = host_vals, None

    def read(self) -> tuple[float, bool, float]:
        """(norm, overflowed, the float32 coefficient as a float)."""
        if self._event is not None:
            self._event.synchronize()
        norm, skip, coef = self._host.tolist()
        return norm, skip > 0, coef
