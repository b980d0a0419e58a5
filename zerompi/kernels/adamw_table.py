"""The optimizer's segment table as one device launch (cuda_src/adamw_table.cu).

A table is built once per shard (build_table): per segment its length and element
offsets into the four base buffers (master, gradient, exp_avg/exp_avg_sq, low-precision
parameter), and a work list of tiles (segment, start, length <= tile) that the kernels
stride over, one block per tile, so any mix of segment sizes is balanced. Each step
only a row of fp32 scalars per segment changes (step_row): per-group hyper-parameters
and per-parameter step counts, rounded as adamw_scalars rounds them, and a flag that
skips a parameter which got no gradient. The numpy references compute the kernels'
results bit for bit (the gradient statistics in the kernels' fixed summation order).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import _loader
from .adamw import adamw_apply, check_adamw_arrays
from .cast import to_float32
from .grad_stats import THREADS as STATS_THREADS
from .grad_stats import strided_sums, tree_sum

SOURCE = "adamw_table.cu"
TILE = 8192  # elements per tile: 32 per thread at 256 threads
SEG_COLS, TILE_COLS, ROW_COLS = 5, 3, 9  # must match adamw_table.cu
SCALAR_KEYS = ("grad_coef", "decay", "w1", "beta2", "c2", "neg_step", "bc2_sqrt", "eps")
ADAMW_THREADS = 256
MAX_BLOCKS = 4096  # grid-stride over tiles beyond this; results never depend on it
BUFFERS = ("master", "grad", "exp_avg", "out")  # segs columns 1..4 (exp_avg_sq: column 3)


@dataclass(frozen=True)
class Table:
    """segs: int64 (nseg, 5) = length, master, grad, moment, out offsets.
    tiles: int64 (ntiles, 3) = segment, start within it, length."""

    segs: np.ndarray
    tiles: np.ndarray

    @property
    def nseg(self) -> int:
        return self.segs.shape[0]

    @property
    def ntiles(self) -> int:
        return self.tiles.shape[0]


def build_table(lengths, master_offs, grad_offs, moment_offs, out_offs=None,
                tile: int = TILE) -> Table:
    """Table of segments with these lengths and element offsets (out_offs None: no
    low-precision output). ``tile``: a positive multiple of 4, so a tile keeps its
    segment's 16-byte vector phase."""
    if tile <= 0 or tile % 4:
        raise ValueError(f"tile must be a positive multiple of 4, got {tile}")
    lengths = np.asarray(lengths, np.int64).reshape(-1)
    if out_offs is None:
        out_offs = np.zeros_like(lengths)
    cols = [lengths] + [np.asarray(o, np.int64).reshape(-1)
                        for o in (master_offs, grad_offs, moment_offs, out_offs)]
    if any(c.shape != lengths.shape for c in cols):
        raise ValueError("lengths and offsets must have one entry per segment")
    segs = np.ascontiguousarray(np.stack(cols, 1)) if lengths.size else np.zeros((0, 5), np.int64)
    if (segs < 0).any():
        raise ValueError("negative segment length or offset")
    count = -(-lengths // tile)
    seg = np.repeat(np.arange(lengths.size, dtype=np.int64), count)
    first = np.repeat(np.cumsum(count) - count, count)  # index of each segment's first tile
    start = (np.arange(seg.size, dtype=np.int64) - first) * tile
    tiles = np.stack([seg, start, np.minimum(tile, lengths[seg] - start)], 1)
    return Table(segs, np.ascontiguousarray(tiles, np.int64))


def check_bounds(table: Table, sizes: dict) -> None:
    """Every segment inside its buffers; ``sizes``: element count per BUFFERS name
    (None: buffer absent). The kernels trust the table, so this runs before binding."""
    for col, name in enumerate(BUFFERS, 1):
        n = sizes.get(name)
        if n is None or not table.nseg:
            continue
        end = table.segs[:, col] + table.segs[:, 0]
        bad = np.nonzero(end > n)[0]
        if bad.size:
            k = int(bad[0])
            raise ValueError(f"segment {k} ends at {int(end[k])} in {name}, which has {n} elements")


def step_row(scalars: dict | None) -> np.ndarray:
    """One segment's per-step row from adamw_scalars(...); None: skip the segment."""
    row = np.zeros(ROW_COLS, np.float32)
    if scalars is not None:
        row[:8] = [scalars[k] for k in SCALAR_KEYS]
        row[8] = 1
    return row


# ------------------------------------------------------------------ references

def adamw_table_reference(master, exp_avg, exp_avg_sq, grad, out, table: Table, rows, *,
                          coef=None, fma=True, sqrt=np.sqrt) -> None:
    """The table kernel on numpy base buffers, in place. ``out``: None, float16 or uint16
    (bf16 bits). ``coef``: None or float32 [grad_coef, skip] (the device coefficient:
    replaces every row's grad_coef; skip != 0 leaves everything unchanged). fma/sqrt as
    adamw_reference (for comparisons with torch on the CPU)."""
    if coef is not None and coef[1] != 0:
        return
    out_tag = None if out is None else _loader.dtype_tag(out.dtype)
    for k in range(table.nseg):
        row = rows[k]
        if row[8] == 0:
            continue
        n, mo, go, vo, oo = (int(x) for x in table.segs[k])
        s = dict(zip(SCALAR_KEYS, row[:8]))
        if coef is not None:
            s["grad_coef"] = np.float32(coef[0])
        low = adamw_apply(master[mo:mo + n], exp_avg[vo:vo + n], exp_avg_sq[vo:vo + n],
                          grad[go:go + n], s, out_tag, fma=fma, sqrt=sqrt)
        if low is not None:
            out[oo:oo + n] = low


def grad_stats_table_reference(grad, table: Table, weights, chunk: int = 256):
    """(weighted sum of g*g, overflow) as the table kernels compute them, bit for bit:
    the sum is +inf on overflow. ``weights``: float64 per segment."""
    T = STATS_THREADS
    weights = np.asarray(weights, np.float64)
    x = to_float32(np.asarray(grad).reshape(-1))
    parts = np.zeros(table.ntiles, np.float64)
    overflow = False
    width = -(-int(table.tiles[:, 2].max(initial=0)) // T) * T
    j = np.arange(width)
    for lo in range(0, table.ntiles, chunk):  # bounded memory: chunk tiles at a time
        tl = table.tiles[lo:lo + chunk]
        mask = j < tl[:, 2:3]
        idx = np.where(mask, table.segs[tl[:, 0], 2][:, None] + tl[:, 1:2] + j, 0)
        vals = np.where(mask, x[idx] if x.size else 0.0, 0.0).astype(np.float64)
        overflow |= not np.all(np.isfinite(vals))
        with np.errstate(all="ignore"):
            sq = vals * vals  # exact; padding adds +0.0, which changes no sum
            acc = np.zeros((tl.shape[0], T))
            for c in range(0, width, T):  # thread t: elements t, t+T, ... in order
                acc += sq[:, c:c + T]
            parts[lo:lo + chunk] = tree_sum(acc) * weights[tl[:, 0]]
    with np.errstate(all="ignore"):
        total = float(tree_sum(strided_sums(parts, T)))
    return (float("inf") if overflow else total), overflow


# ------------------------------------------------------------------ launchers

def _check_table_array(name, a, dtype, dev):
    import cupy

    if not isinstance(a, cupy.ndarray) or a.dtype != dtype or not a.flags.c_contiguous:
        raise TypeError(f"{name} must be a C-contiguous cupy.ndarray of {np.dtype(dtype)}")
    if a.device.id != dev:
        raise ValueError(f"{name} is on device {a.device.id}, the buffers on device {dev}")


def adamw_table_step(master, exp_avg, exp_avg_sq, grad, out, segs, tiles, rows, coef=None) -> None:
    """Launch the table AdamW on cupy base buffers (master/exp_avg/exp_avg_sq float32;
    grad float32/float16/bf16 bits; out None/float16/bf16 bits) on the current stream.
    segs/tiles: a Table's arrays on the device; rows: float32 (nseg, 9) on the device;
    coef: None or float32 [grad_coef, skip] on the device (adamw_table_reference).
    The offsets are not checked here: check_bounds before uploading a table."""
    gt, ot, named = check_adamw_arrays(master, exp_avg, exp_avg_sq, grad, out)
    dev = master.device.id
    for name, a in named:
        if a.device.id != dev:
            raise ValueError(f"{name} is on device {a.device.id} but master is on device {dev}")
    _loader.check_no_overlap(named)
    checks = [("segs", segs, np.int64), ("tiles", tiles, np.int64), ("rows", rows, np.float32)]
    if coef is not None:
        checks.append(("coef", coef, np.float32))
        if coef.size != 2:
            raise ValueError(f"coef has {coef.size} elements, expected 2 (grad_coef, skip)")
    for name, a, dt in checks:
        _check_table_array(name, a, dt, dev)
    ntiles = tiles.shape[0]
    if ntiles == 0:
        return
    out_arg = out if out is not None else np.uint64(0)  # NULL, unused
    coef_arg = coef if coef is not None else np.uint64(0)  # NULL: the rows' grad_coef
    _loader.launch(SOURCE, f"adamw_table_{gt}_{ot}", dev, ntiles,
                   (master, exp_avg, exp_avg_sq, grad, out_arg, segs, tiles,
                    np.int64(ntiles), rows, coef_arg),
                   blocks=min(ntiles, MAX_BLOCKS), threads=ADAMW_THREADS)


def grad_stats_table(grad, segs, tiles, weights, out, scratch=None):
    """Launch both table statistics kernels on the current stream, no host sync.
    ``out``: (float64, int32) 1-element cupy arrays receiving the weighted sum of
    squares (+inf on overflow) and the overflow flag. ``weights``: float64 (nseg,) on
    the device. ``scratch``: optional (float64, int32) arrays of >= ntiles elements."""
    import cupy

    tag = _loader.check_array("grad", grad, ("f32", "bf16", "f16"))
    dev = grad.device.id
    for name, a, dt in (("segs", segs, np.int64), ("tiles", tiles, np.int64),
                        ("weights", weights, np.float64), ("out[0]", out[0], np.float64),
                        ("out[1]", out[1], np.int32)):
        _check_table_array(name, a, dt, dev)
    ntiles = tiles.shape[0]
    if scratch is None:
        with cupy.cuda.Device(dev):
            scratch = (cupy.empty(max(1, ntiles), np.float64), cupy.empty(max(1, ntiles), np.int32))
    if scratch[0].size < ntiles or scratch[1].size < ntiles:
        raise ValueError(f"scratch holds fewer than {ntiles} partials")
    if ntiles:
        _loader.launch(SOURCE, f"grad_stats_table_{tag}", dev, ntiles,
                       (grad, segs, tiles, np.int64(ntiles), weights, scratch[0], scratch[1]),
                       blocks=min(ntiles, MAX_BLOCKS), threads=STATS_THREADS)
    _loader.launch(SOURCE, "grad_stats_table_finish", dev, 1,
                   (scratch[0], scratch[1], np.int64(ntiles), out[0], out[1]),
                   blocks=1, threads=STATS_THREADS)
    return out
