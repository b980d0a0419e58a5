"""Fused inf/nan check + sum of squares of a gradient shard (cuda_src/grad_stats.cu)."""
from __future__ import annotations

import numpy as np

from . import _loader
from .cast import to_float32

SOURCE = "grad_stats.cu"
THREADS = 256  # must equal ZM_STATS_THREADS in grad_stats.cu
MAX_BLOCKS = 1024


def num_blocks(n: int) -> int:
    """Partial-kernel grid size; depends on n only, so results do not depend on the GPU."""
    return max(1, min(-(-n // (THREADS * 8)), MAX_BLOCKS))


def tree_sum(x: np.ndarray) -> np.ndarray:
    """The kernel's shared-memory tree over the last axis (length THREADS)."""
    x = x.copy()
    s = THREADS // 2
    while s:
        x[..., :s] = x[..., :s] + x[..., s:2 * s]
        s //= 2
    return x[..., 0]


def strided_sums(vals: np.ndarray, width: int) -> np.ndarray:
    """acc[t] = vals[t] + vals[t+width] + ... summed left to right (grid-stride order)."""
    acc = np.zeros(width, np.float64)
    for i in range(0, vals.size, width):
        chunk = vals[i:i + width]
        acc[:chunk.size] += chunk
    return acc


def grad_stats_reference(grad: np.ndarray, *, exact_order: bool = False):
    """(sum of g*g as float, any inf/nan as bool) over float32/float16/bf16-bits ``grad``.

    exact_order=True reproduces the kernels' fp64 summation order, hence their
    result bit for bit; otherwise numpy's (pairwise) order is used.
    """
    x = to_float32(np.asarray(grad).reshape(-1)).astype(np.float64)
    overflow = bool(not np.all(np.isfinite(x)))
    with np.errstate(all="ignore"):
        sq = x * x  # exact in fp64
        if not exact_order:
            return float(np.sum(sq)), overflow
        blocks = num_blocks(x.size)
        per_thread = strided_sums(sq, blocks * THREADS)
        parts = tree_sum(per_thread.reshape(blocks, THREADS))
        total = tree_sum(strided_sums(parts, THREADS))
    return float(total), overflow


def compute_grad_stats(grad, out=None):
    """Launch both kernels on cupy ``grad`` (float32, float16 or bf16 bits).

    Returns device arrays ``(sumsq, overflow)``: float64 and int32, one element
    each (no host sync). ``out``: optional pair of such 1-element arrays to fill
    instead, e.g. slices of a larger per-shard array.
    """
    import cupy

    tag = _loader.check_array("grad", grad, ("f32", "bf16", "f16"))
    dev, n = grad.device.id, grad.size
    with cupy.cuda.Device(dev):
        if out is None:
            out = (cupy.empty(1, np.float64), cupy.empty(1, np.int32))
        for name, a, want in (("out[0]", out[0], np.float64), ("out[1]", out[1], np.int32)):
            if not isinstance(a, cupy.ndarray) or a.dtype != want or a.size != 1:
                raise TypeError(f"{name} must be a 1-element cupy.ndarray of {np.dtype(want)}")
            if a.device.id != dev:
                raise ValueError(f"{name} is on device {a.device.id} but grad is on device {dev}")
        blocks = num_blocks(n)
        part_sum = cupy.empty(blocks, np.float64)
        part_flag = cupy.empty(blocks, np.int32)
    _loader.launch(SOURCE, f"grad_stats_partial_{tag}", dev, n,
                   (grad, np.int64(n), part_sum, part_flag), blocks=blocks, threads=THREADS)
    _loader.launch(SOURCE, "grad_stats_finish", dev, blocks,
                   (part_sum, part_flag, np.int32(blocks), out[0], out[1]),
                   blocks=1, threads=THREADS)
    return out
