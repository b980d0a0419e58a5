"""Shared inputs and comparisons for the kernel tests (test_kernels*.py)."""
from __future__ import annotations

import shutil
import subprocess

import numpy as np

from zerompi.kernels import _loader
from zerompi.kernels import cast as kcast
from zerompi.kernels.cast import to_float32

CUDA_SRC = _loader.cuda_src_dir()
SOURCES = sorted(CUDA_SRC.glob("*.cu"))
NVCC = shutil.which("nvcc")
TAGS = ("f32", "bf16", "f16")
HPARAMS = [  # second set has 1 - beta1 >= 0.5: torch's other lerp formula
    dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01),
    dict(lr=0.1, beta1=0.3, beta2=0.5, eps=1e-6, weight_decay=0.1),
    dict(lr=3e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0),
]


def assert_same(got, want, what=""):
    """Bitwise equality, except that any NaN matches any NaN (payloads differ by platform)."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape, what
    gf, wf = to_float32(got), to_float32(want)
    gn, wn = np.isnan(gf), np.isnan(wf)
    assert np.array_equal(gn, wn), f"{what}: NaN positions differ"
    k = got.itemsize
    gb, wb = got.reshape(-1).view(np.uint8), want.reshape(-1).view(np.uint8)
    bad = np.nonzero((gb.reshape(-1, k) != wb.reshape(-1, k)).any(1) & ~gn.reshape(-1))[0]
    i = bad[:5]
    assert bad.size == 0, f"{what}: {bad.size} mismatches, first at {i}: {gf[i]} vs {wf[i]}"


def encode(x32, tag):
    return kcast.from_float32(x32, tag)


def make_grad(n, rng, specials=True):
    """Gradients spanning ~1e-22..1e2, with fp32 subnormals, zeros and (optionally) inf/nan."""
    g = (rng.standard_normal(n) * np.exp(rng.uniform(-50, 5, n))).astype(np.float32)
    if n >= 16:
        g[1], g[3], g[5] = 0.0, -0.0, np.float32(1e-40)
        g[7] = np.float32(-3e-39)
        if specials:
            g[9], g[11] = np.inf, np.nan
    return g


def adamw_inputs(n, gtag, rng, specials=True):
    master = rng.standard_normal(n).astype(np.float32)
    m = (rng.standard_normal(n) * 0.1).astype(np.float32)
    v = (np.abs(rng.standard_normal(n)) * 1e-3).astype(np.float32)
    if n >= 16:
        v[13] = np.float32(2e-42)  # subnormal second moment
    return master, m, v, encode(make_grad(n, rng, specials), gtag)

# sizes and element offsets (misaligned starts) every kernel comparison runs over
SIZES = (0, 1, 7, 1023, 100003)
OFFSETS = ((0, 0, 0, 0, 0), (1, 1, 1, 1, 1), (3, 3, 3, 3, 3), (0, 1, 0, 2, 3))  # last: scalar path


# ---- segment tables (adamw_table.cu): odd lengths, shuffled order, odd gaps/offsets
TABLE_LENGTHS = (37, 0, 1, 300, 7, 1023, 5, 129, 64, 3)


def _place(rng, lengths):
    """Offsets of segments packed into one buffer in random order with 0-2 element
    gaps; returns (offsets, buffer size)."""
    offs = np.zeros(len(lengths), np.int64)
    pos = int(rng.integers(0, 3))
    for k in rng.permutation(len(lengths)):
        offs[k] = pos
        pos += lengths[k] + int(rng.integers(0, 3))
    return offs, pos + 3


def table_inputs(rng, gtag, otag, lengths=TABLE_LENGTHS, tile=64, skip=(2, 5)):
    """A random segment table over four base buffers, its step rows (segments `skip`
    skipped; per-segment hyper-parameters and steps) and the buffers' contents."""
    from zerompi.kernels import adamw as kadamw
    from zerompi.kernels import adamw_table as kt

    lengths = np.asarray(lengths, np.int64)
    (mo, mn), (go, gn), (vo, vn), (oo, on) = (_place(rng, lengths) for _ in range(4))
    table = kt.build_table(lengths, mo, go, vo, oo if otag != "none" else None, tile=tile)
    rows = np.stack([kt.step_row(None if k in skip else kadamw.adamw_scalars(
        step=1 + k % 4, grad_coef=(0.5, 1.0, 3e-3)[k % 3], **HPARAMS[k % len(HPARAMS)]))
        for k in range(lengths.size)])
    master, m, v, g = adamw_inputs(max(mn, vn, gn), gtag, rng)
    bufs = {"master": master[:mn].copy(), "exp_avg": m[:vn].copy(), "exp_avg_sq": v[:vn].copy(),
            "grad": g[:gn].copy(),
            "out": None if otag == "none" else encode(rng.standard_normal(on).astype(np.float32), otag)}
    return table, rows, bufs


def build_host_harness(d, source: str) -> str:
    """Compile a harness that runs the kernels' __host__ __device__ loop bodies on the CPU
    (nvcc as a host compiler, no FMA contraction); returns the executable's path."""
    (d / "harness.cu").write_text(source)
    cmd = [NVCC, "-std=c++17", "-O1", "-arch=sm_80", f"-I{CUDA_SRC}", "-Xcompiler",
           "-ffp-contract=off,-fno-strict-aliasing", "-o", str(d / "harness"), str(d / "harness.cu")]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    return str(d / "harness")
