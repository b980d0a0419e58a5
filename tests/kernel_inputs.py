"""Shared inputs and comparisons for the kernel tests (test_kernels*.py)."""
from __future__ import annotations

import shutil

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
