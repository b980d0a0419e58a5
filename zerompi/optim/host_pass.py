"""The offloaded optimizer's update as one fused pass over the host shard.

HostPassAdamW keeps ShardedAdamW's bookkeeping (segments, steps, param_groups,
state_dict; its views are whatever the caller gives, zero/offload.py: the device's) and
updates shard-indexed host buffers: the fp32 master and moments, a gradient staging
buffer in the gradient's own dtype, and an output staging buffer in the parameter dtype
that the caller uploads. The shard is cut into upload tiles (zero/offload.py picks
them) and each tile into work units of at most UNIT elements, covering every element,
padding included: a segment that got no gradient, and padding, only refresh the output
from the master, so the whole output staging is valid after every pass.

Two kernels, one interface (launch() -> a job with wait(tile) and join()):
  compiled  cuda_src/host_adamw.cpp (host_kernel.py): unscale x clip, AdamW and the
            cast in one read and one write of every byte, on `threads` threads, started
            at once; the CUDA kernels' arithmetic, bit for bit their numpy reference.
  torch     per tile: the gradient to fp32 times the coefficient, torch._fused_adamw_,
            a copy into the output (or ShardedAdamW's ops where torch has no CPU fused
            AdamW); computed on demand by wait(tile), or on a thread (background=True).
            Not bitwise the compiled pass (fused rounding), within a few ulps.
"""
from __future__ import annotations

import threading
import time
from typing import Sequence

import numpy as np
import torch

from . import host_fused, host_kernel
from .adamw import ShardedAdamW
from .fused_adamw import scalar_rows

UNIT = 1 << 15  # elements per work unit: ~1 MB of traffic, thousands per GiB-sized shard
KERNELS = ("auto", "compiled", "torch")


def build_units(segments, owned: int, bounds: Sequence[int], unit: int = UNIT) -> np.ndarray:
    """int64 [n, 4] rows (shard offset, length, segment index or -1, tile) covering
    [0, owned) in order: segments by their shard offset, gaps as -1, cut at every tile
    bound (bounds: 0 = b0 < b1 < ... = owned) and into pieces of at most `unit`."""
    if list(bounds[:1]) != [0] or bounds[-1] != owned or any(b <= a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"tile bounds must rise from 0 to {owned}, got {list(bounds)[:4]}...")
    runs, pos = [], 0
    for k, s in sorted(enumerate(segments), key=lambda ks: ks[1].shard_lo):
        if s.shard_lo < pos or s.shard_lo + s.length > owned:
            raise ValueError(f"segment {k} at {s.shard_lo}+{s.length} overlaps or leaves the shard")
        if s.shard_lo > pos:
            runs.append((pos, s.shard_lo, -1))
        runs.append((s.shard_lo, s.shard_lo + s.length, k))
        pos = s.shard_lo + s.length
    if pos < owned:
        runs.append((pos, owned, -1))
    out, t = [], 0
    for lo, hi, k in runs:
        while lo < hi:
            while bounds[t + 1] <= lo:
                t += 1
            end = min(hi, bounds[t + 1], lo + unit)
            out.append((lo, end - lo, k, t))
            lo = end
    return np.array(out, np.int64).reshape(-1, host_kernel.UNIT_COLS)


class _TorchJob:
    """The torch kernel behind the compiled job's interface."""

    def __init__(self, run_tile, ntiles: int, background: bool):
        self.run_tile, self.ntiles, self.next = run_tile, ntiles, 0
        self.thread, self.seconds, self.t0 = None, None, time.perf_counter()
        if background:
            self.thread = threading.Thread(target=self._upto, args=(ntiles - 1,), name="zerompi-host-pass",
                                           daemon=True)
            self.thread.start()

    def _upto(self, tile: int) -> None:
        while self.next <= tile:
            self.run_tile(self.next)
            self.next += 1
            if self.next == self.ntiles:
                self.seconds = time.perf_counter() - self.t0

    def wait(self, tile: int) -> None:
        if self.thread is not None:
            self.join()
        self._upto(tile)

    def join(self) -> None:
        if self.thread is not None:
            t, self.thread = self.thread, None
            t.join()
        self._upto(self.ntiles - 1)


class HostPassAdamW(ShardedAdamW):
    """AdamW over host buffers as one pass; see the module docstring.

    bufs: master, exp_avg, exp_avg_sq (fp32), grad and out: lists of staging buffers
    (one, or two that alternate with the delayed update), all shard-indexed, `owned`
    elements. views: ShardState-style views for the engine's other users."""

    def __init__(self, segments, views, param_groups: list[dict], num_params: int, *, bufs: dict,
                 owned: int, bounds: Sequence[int], threads: int, kernel: str = "auto"):
        super().__init__(segments, views, param_groups, num_params)
        if kernel not in KERNELS:
            raise ValueError(f"host pass kernel {kernel!r}: one of {KERNELS}")
        self.bufs, self.owned, self.threads = bufs, owned, max(1, int(threads))
        self.bounds = list(bounds)
        self.ntiles = len(self.bounds) - 1
        self.units = build_units(self.segments, owned, self.bounds)
        self._seg_param = np.array([s.param for s in self.segments], np.int64)
        self._seg_group = np.array([s.group for s in self.segments], np.int64)
        self.kernel = "torch" if kernel == "torch" else "compiled"
        if kernel != "torch" and host_kernel.library() is None:
            if kernel == "compiled":
                raise RuntimeError(f"offload.host_pass = compiled: {host_kernel.reason()}")
            self.kernel = "torch"
        self.fallback_reason = host_kernel.reason() if kernel == "auto" and self.kernel == "torch" else None
        self._last_coef = 1.0
        self._used = None

    # ------------------------------------------------------------ per step
    def rows(self, grad_coef: float, used: Sequence[bool] | None) -> np.ndarray:
        """fp32 scalar rows (nseg, 9) for the counts already advanced (fused_adamw.scalar_rows)."""
        return scalar_rows(self._seg_param, self._seg_group, self.steps, self.groups, grad_coef, used)

    def launch(self, grad_coef: float = 1.0, used: Sequence[bool] | None = None, slot: int = 0,
               threads: int | None = None, background: bool = False):
        """Count the step and start the pass over staging pair `slot`; returns the job."""
        self._count_steps(used)
        grad, out = self.bufs["grad"][slot], self.bufs["out"][slot]
        if self.kernel == "compiled":
            b = self.bufs
            return host_kernel.launch(b["master"], b["exp_avg"], b["exp_avg_sq"], grad, out, self.units,
                                      self.rows(grad_coef, used), self.ntiles, threads or self.threads)
        # the hyper-parameters as of the launch: a scheduler may change them while it runs
        self._last_coef, self._used, self._hp = grad_coef, used, [dict(g) for g in self.groups]
        return _TorchJob(lambda t: self._torch_tile(t, grad, out), self.ntiles, background)

    def step(self, grad_coef: float | None = None, used: Sequence[bool] | None = None) -> None:
        """The whole pass over staging pair 0, waited for (ShardedAdamW's interface)."""
        self.launch(self._engine_call(grad_coef), used).join()

    # ------------------------------------------------------------ torch kernel
    def _torch_tile(self, tile: int, grad: torch.Tensor, out: torch.Tensor) -> None:
        b, coef, used = self.bufs, self._last_coef, self._used
        lo_u, hi_u = np.searchsorted(self.units[:, 3], [tile, tile + 1])
        batches: dict[tuple[int, int], list] = {}
        for off, n, k, _ in self.units[lo_u:hi_u].tolist():
            if k >= 0 and (used is None or used[self.segments[k].param]):
                s = self.segments[k]
                g = grad[off:off + n].to(torch.float32, copy=True).mul_(coef)
                batches.setdefault((s.group, self.steps[s.param]), []).append(
                    (b["master"][off:off + n], g, b["exp_avg"][off:off + n], b["exp_avg_sq"][off:off + n]))
        for (group, step), vs in batches.items():
            hp = self._hp[group]
            beta1, beta2 = hp["betas"]
            if host_fused.available():
                torch._fused_adamw_([v[0] for v in vs], [v[1] for v in vs], [v[2] for v in vs],
                                    [v[3] for v in vs], [], [torch.tensor(float(step))] * len(vs),
                                    lr=float(hp["lr"]), beta1=float(beta1), beta2=float(beta2),
                                    weight_decay=float(hp["weight_decay"]), eps=float(hp["eps"]),
                                    amsgrad=False, maximize=False)
            else:  # ShardedAdamW's ops on the piece (torch < 2.4 has no fused CPU AdamW)
                for p, g, m, v in vs:
                    _torch_ops(p, g, m, v, hp, step)
        lo, hi = self.bounds[tile], self.bounds[tile + 1]
        if out is not None:
            out[lo:hi].copy_(b["master"][lo:hi])


def _torch_ops(p, g, exp_avg, exp_avg_sq, hp, step) -> None:
    lr, (beta1, beta2), eps, wd = hp["lr"], hp["betas"], hp["eps"], hp["weight_decay"]
    if wd != 0:
        p.mul_(1 - lr * wd)
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    denom = (exp_avg_sq.sqrt() / (1 - beta2 ** step) ** 0.5).add_(eps)
    p.addcdiv_(exp_avg, denom, value=-lr / (1 - beta1 ** step))
