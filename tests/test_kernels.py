"""Tests for zerompi.kernels and cuda_src/.

CPU (always): numpy references vs torch/numpy; argument checks; the kernels' loop
bodies compiled by nvcc as host code and run on the CPU (bitwise vs references);
nvcc and (when libnvrtc is found) NVRTC compiles. GPU: kernels vs references.
"""
from __future__ import annotations

import ctypes
import glob
import os
import shutil
import subprocess
import sys
import types

import numpy as np
import pytest
import torch

from zerompi.kernels import _loader
from zerompi.kernels import adamw as kadamw
from zerompi.kernels import cast as kcast
from zerompi.kernels import grad_stats as kstats
from zerompi.kernels.cast import (bf16_bits_to_float32, float32_to_bf16_bits,
                                  float32_to_fp16_bits, fp16_bits_to_float32, to_float32)

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


# ---------------------------------------------------------------- conversions

def _sweep_f32():
    """All 65536 high halves x low halves that probe ties, near-ties and payloads."""
    hi = np.arange(1 << 16, dtype=np.uint32) << 16
    lo = np.array([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF, 0x1000, 0x0FFF, 0x2000, 0x3000,
                   0x5A5A], np.uint32)
    bits = (hi[:, None] | lo[None, :]).reshape(-1)
    return np.concatenate([bits, np.array([0x7F7FFFFF, 0xFF7FFFFF, 0x477FEFFF, 0x477FF000,
                                           0x33000000, 0x33000001, 0x387FE000], np.uint32)])


def test_bf16_rne_matches_torch():
    x = _sweep_f32().view(np.float32)
    mine = float32_to_bf16_bits(x)
    theirs = torch.from_numpy(x.copy()).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert_same(mine, theirs, "f32->bf16")  # NaN payloads vary by torch CPU path
    nan_in = np.isnan(x)
    assert np.array_equal(mine[nan_in] >> 15, x.view(np.uint32)[nan_in] >> 31), "NaN sign kept"
    allb = np.arange(1 << 16, dtype=np.uint16)
    back = torch.from_numpy(allb.view(np.int16).copy()).view(torch.bfloat16).float().numpy()
    assert np.array_equal(bf16_bits_to_float32(allb).view(np.uint32), back.view(np.uint32))
    assert float32_to_bf16_bits(np.finfo(np.float32).max) == 0x7F80  # rounds to inf


def test_fp16_rne_matches_numpy():
    x = _sweep_f32().view(np.float32)
    with np.errstate(all="ignore"):
        ref = x.astype(np.float16)
    assert_same(float32_to_fp16_bits(x).view(np.float16), ref, "f32->f16")
    allh = np.arange(1 << 16, dtype=np.uint16)
    assert_same(fp16_bits_to_float32(allh), allh.view(np.float16).astype(np.float32), "f16->f32")
    # torch (F16C / c10) agrees on everything but NaN payloads too
    t = torch.from_numpy(x.copy()).to(torch.float16).numpy()
    assert_same(float32_to_fp16_bits(x).view(np.float16), t, "f32->f16 vs torch")


def test_cast_and_scaled_copy_references_match_torch():
    rng = np.random.default_rng(3)
    x = make_grad(1001, rng)
    for tag, tdt in (("bf16", torch.bfloat16), ("f16", torch.float16)):
        low = kcast.cast_reference(x, tag)
        tl = torch.from_numpy(x).to(tdt)
        assert_same(to_float32(low), tl.float().numpy(), f"cast {tag}")
        assert_same(kcast.cast_reference(low, "f32"), tl.float().numpy(), f"widen {tag}")
        for acc in (False, True):
            dst0 = rng.standard_normal(x.size).astype(np.float32)
            dst = kcast.scaled_copy_reference(low, dst0.copy(), 0.37, acc)
            want = tl.float() * 0.37
            want = want + torch.from_numpy(dst0) if acc else want
            assert_same(dst, want.numpy(), f"scaled_copy {tag} acc={acc}")


# ------------------------------------------------------------------ AdamW

def test_fma32_is_correctly_rounded():
    u = np.float32(2.0 ** -12)
    a, b = np.float32(1) + u, np.float32(1) + 3 * u
    tiny = np.float32(2.0 ** -80)
    # a*a = 1 + 2^-11 + 2^-24: a tie that float64 alone would round wrongly
    assert kadamw.fma32(a, a, tiny) == np.float32(1 + 2.0 ** -11 + 2.0 ** -23)
    assert kadamw.fma32(a, a, -tiny) == np.float32(1 + 2.0 ** -11)
    assert kadamw.fma32(a, a, 0) == np.float32(1 + 2.0 ** -11)  # tie to even
    # a*b = 1 + 2^-10 + 3*2^-24: tie between odd and even neighbours
    assert kadamw.fma32(a, b, -tiny) == np.float32(1 + 2.0 ** -10 + 2.0 ** -23)
    assert kadamw.fma32(a, b, 0) == np.float32(1 + 2.0 ** -10 + 2.0 ** -22)
    assert np.isnan(kadamw.fma32(np.inf, 0, 1)) and kadamw.fma32(2, 3, np.inf) == np.inf


def _torch_lerp_is_fused() -> bool:
    """torch's vectorised CPU lerp/addcmul use FMAs (AVX2/AVX512/NEON); plain x86 does not."""
    rng = np.random.default_rng(0)
    m, g = (rng.standard_normal(4096).astype(np.float32) for _ in range(2))
    w = np.float32(1 - 0.9)
    t = torch.from_numpy(m.copy()).lerp_(torch.from_numpy(g), 1 - 0.9).numpy()
    fused, plain = kadamw.fma32(w, g - m, m), m + w * (g - m)
    assert np.array_equal(t, fused) or np.array_equal(t, plain), "torch lerp matches neither form"
    return np.array_equal(t, fused)


def _torch_sqrt(x):
    return torch.from_numpy(np.ascontiguousarray(x)).sqrt().numpy()


@pytest.mark.parametrize("hp", HPARAMS, ids=["default", "large_lerp_w", "no_wd"])
def test_adamw_reference_matches_torch(hp):
    fused = _torch_lerp_is_fused()
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        assert fused  # so the kernel's FMA placement is torch's on x86 CI
    rng = np.random.default_rng(7)
    n = 10007
    p0 = rng.standard_normal(n).astype(np.float32)
    tp = torch.nn.Parameter(torch.from_numpy(p0.copy()))
    opt = torch.optim.AdamW([tp], lr=hp["lr"], betas=(hp["beta1"], hp["beta2"]), eps=hp["eps"],
                            weight_decay=hp["weight_decay"], foreach=False)
    exact = [p0.copy(), np.zeros(n, np.float32), np.zeros(n, np.float32)]  # torch's sqrt
    kern = [a.copy() for a in exact]  # kernel arithmetic: correctly rounded sqrt
    for step in range(1, 6):
        g = make_grad(n, rng, specials=False)
        tp.grad = torch.from_numpy(g.copy())
        opt.step()
        st = opt.state[tp]
        tw = [tp.detach().numpy(), st["exp_avg"].numpy(), st["exp_avg_sq"].numpy()]
        kadamw.adamw_reference(*exact, g, fma=fused, sqrt=_torch_sqrt, step=step, **hp)
        for got, want, name in zip(exact, tw, ("param", "exp_avg", "exp_avg_sq")):
            assert_same(got, want, f"step {step} {name}")
        kadamw.adamw_reference(*kern, g, step=step, **hp)
        if fused:
            assert_same(kern[1], tw[1], "exp_avg")
            assert_same(kern[2], tw[2], "exp_avg_sq")
        # torch's CPU sqrt (MKL) is not correctly rounded: the kernel differs by a few ulp
        err = np.abs(kern[0] - tw[0])
        assert np.all(err <= 8 * np.spacing(np.abs(tw[0])) + 1e-5 * hp["lr"] * step), err.max()


def test_adamw_reference_grad_coef_and_low_precision_out():
    rng = np.random.default_rng(11)
    for gtag in TAGS:
        master, m, v, g = adamw_inputs(257, gtag, rng)
        coef = 0.7 / 1024
        a = [master.copy(), m.copy(), v.copy()]
        b = [master.copy(), m.copy(), v.copy()]
        kadamw.adamw_reference(*a, g, grad_coef=coef, step=3, **HPARAMS[0])
        g_scaled = to_float32(g) * np.float32(coef)  # what torch would see after grad.mul_(coef)
        kadamw.adamw_reference(*b, g_scaled, step=3, **HPARAMS[0])
        for x, y in zip(a, b):
            assert_same(x, y, gtag)
        for out, tdt in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
            c = [master.copy(), m.copy(), v.copy()]
            low = kadamw.adamw_reference(*c, g, out, grad_coef=coef, step=3, **HPARAMS[0])
            assert_same(to_float32(low), torch.from_numpy(c[0]).to(tdt).float().numpy(), out)
        assert kadamw.adamw_reference(*c, g, None, step=4, **HPARAMS[0]) is None


# ------------------------------------------------------------- grad stats

@pytest.mark.parametrize("tag", TAGS)
def test_grad_stats_reference(tag):
    rng = np.random.default_rng(5)
    for n in (0, 1, 7, 1023, 100003, 600000):
        x = encode(make_grad(n, rng, specials=False) * np.float32(100), tag)
        s, ovf = kstats.grad_stats_reference(x)
        se, ovfe = kstats.grad_stats_reference(x, exact_order=True)
        want = float((torch.from_numpy(to_float32(x)).double() ** 2).sum())
        bound = 2 * max(n, 1) * 2.0 ** -53 * want  # both sum exact squares in fp64
        assert abs(s - want) <= bound and abs(se - want) <= bound
        assert not ovf and not ovfe
        if n:
            for bad in (np.inf, -np.inf, np.nan):
                y = to_float32(x).copy()
                y[n // 2] = bad
                assert kstats.grad_stats_reference(encode(y, tag))[1]
                assert kstats.grad_stats_reference(encode(y, tag), exact_order=True)[1]
    assert not kstats.grad_stats_reference(np.array([65504.0], np.float16))[1]
    s, ovf = kstats.grad_stats_reference(np.array([3e38, -3e38], np.float32))
    assert np.isfinite(s) and not ovf  # fp64 squares of finite fp32 never overflow


# ------------------------------------------------- argument checks (no GPU)

class FakeDev:
    """Duck-typed stand-in with the cupy.ndarray attributes the checks read."""

    def __init__(self, n, dtype=np.float32, ptr=1 << 20, device=0, contiguous=True):
        self.dtype, self.size = np.dtype(dtype), n
        self.itemsize = self.dtype.itemsize
        self.nbytes = n * self.itemsize
        self.data = types.SimpleNamespace(ptr=ptr)
        self.device = types.SimpleNamespace(id=device)
        self.flags = types.SimpleNamespace(c_contiguous=contiguous)


def _adamw_args(n=10, **over):
    base = dict(master=FakeDev(n, ptr=1 << 20), exp_avg=FakeDev(n, ptr=2 << 20),
                exp_avg_sq=FakeDev(n, ptr=3 << 20), grad=FakeDev(n, np.uint16, ptr=4 << 20))
    base.update(over)
    return base


@pytest.mark.parametrize("over, exc, words", [
    (dict(master=np.zeros(10, np.float32)), TypeError, "master must be a cupy.ndarray"),
    (dict(exp_avg=FakeDev(10, np.float16, ptr=2 << 20)), TypeError, "exp_avg has dtype float16"),
    (dict(grad=FakeDev(10, np.float64, ptr=4 << 20)), TypeError, "grad has dtype float64"),
    (dict(exp_avg_sq=FakeDev(10, ptr=3 << 20, contiguous=False)), ValueError,
     "exp_avg_sq must be C-contiguous"),
    (dict(grad=FakeDev(11, np.uint16, ptr=4 << 20)), ValueError, "grad has 11 elements"),
    (dict(exp_avg=FakeDev(10, ptr=2 << 20, device=1)), ValueError, "exp_avg is on device 1"),
    (dict(exp_avg=FakeDev(10, ptr=(1 << 20) + 8)), ValueError, "overlap"),
    (dict(master=FakeDev(10, ptr=(1 << 20) + 2)), ValueError, "not aligned"),
    (dict(out_param=FakeDev(10, np.float32, ptr=5 << 20)), TypeError,
     "out_param has dtype float32"),
])
def test_adamw_step_checks_before_launch(over, exc, words):
    with pytest.raises(exc, match=words):
        kadamw.adamw_step(**_adamw_args(**over), step=1, **HPARAMS[0])


def test_other_entry_point_checks():
    with pytest.raises(TypeError, match="cast_into supports"):
        kcast.cast_into(FakeDev(4), FakeDev(4, ptr=2 << 20))
    with pytest.raises(TypeError, match="dst has dtype float16"):
        kcast.scaled_copy(FakeDev(4, np.uint16), FakeDev(4, np.float16, ptr=2 << 20))
    with pytest.raises(ValueError, match="overlap"):
        kcast.cast_into(FakeDev(4), FakeDev(4, np.uint16, ptr=(1 << 20) + 4))
    with pytest.raises(ValueError, match="step must be >= 1"):
        kadamw.adamw_scalars(step=0, **HPARAMS[0])
    assert _loader.dtype_tag(np.int16) == "bf16" and _loader.dtype_tag(np.float64) is None


def test_loader_source_is_self_contained(monkeypatch, tmp_path):
    for src in SOURCES:
        text = _loader.load_source(src.name)
        assert "#include" not in text and "#pragma once" not in text
        assert '#line 1 "common.cuh"' in text and 'extern "C" __global__' in text
    monkeypatch.setenv("ZEROMPI_CUDA_SRC", str(tmp_path))
    (tmp_path / "common.cuh").write_text("// empty\n")
    assert _loader.cuda_src_dir() == tmp_path


# ------------------------------------- kernel loop bodies run on the CPU
# The kernels' __host__ __device__ loop bodies, called for thread ids 0..T-1 in
# turn: checks indexing, vector/peel/tail paths and arithmetic without a GPU.
HARNESS_CU = r"""
// Runs the kernels' loop bodies on the CPU, emulating T threads one after another.
#include "adamw.cu"
#include "cast.cu"
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

typedef std::vector<unsigned char> Bytes;
static Bytes slurp(const std::string& path) {
  Bytes b; FILE* f = fopen(path.c_str(), "rb"); if (!f) exit(2);
  int c; while ((c = fgetc(f)) != EOF) b.push_back((unsigned char)c);
  fclose(f); return b;
}
static void dump(const std::string& path, const void* p, size_t nbytes) {
  FILE* f = fopen(path.c_str(), "wb"); if (!f) exit(3);
  fwrite(p, 1, nbytes, f); fclose(f);
}
// Copies a file's bytes to element offset `off` of a 64-byte aligned block.
struct Buf {
  Bytes raw; unsigned char* p;
  Buf(const Bytes& d, size_t elt, size_t off) : raw(d.size() + elt * off + 128) {
    p = (unsigned char*)(((unsigned long long)raw.data() + 63) & ~63ull) + elt * off;
    if (!d.empty()) memcpy(p, d.data(), d.size());
  }
};
static float hexf(const char* s) { return zm_u2f((u32)strtoul(s, 0, 16)); }

template <class G, class O> static void adamw(char** a) {
  usize n = strtoull(a[0], 0, 10), T = strtoull(a[1], 0, 10);
  std::string d = a[15];
  Buf p(slurp(d + "/p.bin"), 4, atoi(a[2])), m(slurp(d + "/m.bin"), 4, atoi(a[3]));
  Buf v(slurp(d + "/v.bin"), 4, atoi(a[4]));
  Buf g(slurp(d + "/g.bin"), sizeof(typename G::storage), atoi(a[5]));
  Buf o(Bytes(2 * n, 0), 2, atoi(a[6]));
  AdamWArgs s = {hexf(a[7]), hexf(a[8]), hexf(a[9]), hexf(a[10]),
                 hexf(a[11]), hexf(a[12]), hexf(a[13]), hexf(a[14])};
  for (usize t = 0; t < T; ++t)
    adamw_range<G, O>((float*)p.p, (float*)m.p, (float*)v.p, (const typename G::storage*)g.p,
                      O::present ? (typename O::storage*)o.p : 0, n, s, t, T);
  dump(d + "/p.out", p.p, 4 * n); dump(d + "/m.out", m.p, 4 * n); dump(d + "/v.out", v.p, 4 * n);
  dump(d + "/o.out", o.p, 2 * n);
}
template <class I, class O, bool S> static void cast(char** a) {
  usize n = strtoull(a[0], 0, 10), T = strtoull(a[1], 0, 10);
  std::string d = a[6];
  Buf in(slurp(d + "/in.bin"), sizeof(typename I::storage), atoi(a[2]));
  Buf out(slurp(d + "/out.bin"), sizeof(typename O::storage), atoi(a[3]));
  for (usize t = 0; t < T; ++t)
    cast_range<I, O, S>((const typename I::storage*)in.p, (typename O::storage*)out.p, n,
                        hexf(a[4]), atoi(a[5]) != 0, t, T);
  dump(d + "/out.out", out.p, sizeof(typename O::storage) * n);
}
#define ZM_ON(TAG, TYPE, CALL) if (std::string(TAG) == #TYPE) { CALL; return 0; }
int main(int argc, char** argv) {
  if (argc < 4) return 1;
  std::string op = argv[1];
  char** a = argv + 4;
  const char *x = argv[2], *y = argv[3];
#define ZM_ADAMW_O(G) ZM_ON(y, none, (adamw<G, NoOut>(a))) \
    ZM_ON(y, bf16, (adamw<G, BF16>(a))) ZM_ON(y, f16, (adamw<G, F16>(a)))
  if (op == "adamw") {
    if (std::string(x) == "f32") { ZM_ADAMW_O(F32) }
    if (std::string(x) == "bf16") { ZM_ADAMW_O(BF16) }
    if (std::string(x) == "f16") { ZM_ADAMW_O(F16) }
  }
  if (op == "cast") {
    if (std::string(x) == "f32") {
      ZM_ON(y, bf16, (cast<F32, BF16, false>(a))) ZM_ON(y, f16, (cast<F32, F16, false>(a)))
    }
    if (std::string(y) == "f32") {
      ZM_ON(x, bf16, (cast<BF16, F32, false>(a))) ZM_ON(x, f16, (cast<F16, F32, false>(a)))
    }
  }
  if (op == "scaled") {
    ZM_ON(x, f32, (cast<F32, F32, true>(a))) ZM_ON(x, bf16, (cast<BF16, F32, true>(a)))
    ZM_ON(x, f16, (cast<F16, F32, true>(a)))
  }
  return 1;
}
"""
KERNEL_SCALARS = ("grad_coef", "decay", "w1", "beta2", "c2", "neg_step", "bc2_sqrt", "eps")
SIZES = (0, 1, 7, 1023, 100003)
OFFSETS = ((0, 0, 0, 0, 0), (1, 1, 1, 1, 1), (3, 3, 3, 3, 3), (0, 1, 0, 2, 3))  # last: scalar path


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    if NVCC is None:
        pytest.skip("nvcc not found on PATH")
    d = tmp_path_factory.mktemp("harness")
    (d / "harness.cu").write_text(HARNESS_CU)
    cmd = [NVCC, "-std=c++17", "-O1", "-arch=sm_80", f"-I{CUDA_SRC}", "-Xcompiler",
           "-ffp-contract=off,-fno-strict-aliasing", "-o", str(d / "harness"),
           str(d / "harness.cu")]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    return str(d / "harness")


def _hex(x):
    return f"{int(np.float32(x).view(np.uint32)):08x}"


def _threads(n):
    return 3 if n < 100 else 97


@pytest.mark.parametrize("gtag", TAGS)
def test_host_adamw_matches_reference(harness, gtag, tmp_path):
    rng = np.random.default_rng(21)
    hp = HPARAMS[0]
    for otag in ("none", "bf16", "f16"):
        for n in SIZES:
            for offs in OFFSETS:
                master, m, v, g = adamw_inputs(n, gtag, rng)
                for name, a in zip("pmvg", (master, m, v, g)):
                    (tmp_path / f"{name}.bin").write_bytes(a.tobytes())
                sc = kadamw.adamw_scalars(step=2, grad_coef=0.75, **hp)
                cmd = [harness, "adamw", gtag, otag, str(n), str(_threads(n)), *map(str, offs),
                       *(_hex(sc[k]) for k in KERNEL_SCALARS), str(tmp_path)]
                subprocess.run(cmd, check=True)
                low = kadamw.adamw_reference(master, m, v, g, None if otag == "none" else otag,
                                             step=2, grad_coef=0.75, **hp)
                what = f"{gtag}->{otag} n={n} offs={offs}"
                for name, want in zip("pmv", (master, m, v)):
                    got = np.fromfile(tmp_path / f"{name}.out", np.float32)
                    assert_same(got, want, f"{what} {name}")
                if low is not None:
                    got = np.fromfile(tmp_path / "o.out", np.uint16).view(low.dtype)
                    assert_same(got, low, f"{what} out")


@pytest.mark.parametrize("op, src, dst", [("cast", "f32", "bf16"), ("cast", "f32", "f16"),
                                          ("cast", "bf16", "f32"), ("cast", "f16", "f32"),
                                          ("scaled", "f32", "f32"), ("scaled", "bf16", "f32"),
                                          ("scaled", "f16", "f32")])
def test_host_cast_matches_reference(harness, op, src, dst, tmp_path):
    rng = np.random.default_rng(22)
    for n in SIZES:
        for offs in OFFSETS[:3] + ((2, 0),):
            for acc in ((0, 1) if op == "scaled" else (0,)):
                x = encode(make_grad(n, rng) * np.float32(1e3), src)
                out0 = encode(rng.standard_normal(n).astype(np.float32), dst)
                (tmp_path / "in.bin").write_bytes(x.tobytes())
                (tmp_path / "out.bin").write_bytes(out0.tobytes())
                scale = 1.0 if op == "cast" else 3.0e-3
                cmd = [harness, op, src, dst, str(n), str(_threads(n)), str(offs[0]), str(offs[1]),
                       _hex(scale), str(acc), str(tmp_path)]
                subprocess.run(cmd, check=True)
                if op == "cast":
                    want = kcast.cast_reference(x, dst)
                else:
                    want = kcast.scaled_copy_reference(x, out0.copy(), scale, bool(acc))
                got = np.fromfile(tmp_path / "out.out", want.dtype)
                assert_same(got, want, f"{op} {src}->{dst} n={n} offs={offs} acc={acc}")


# --------------------------------------------------------------- compiles

needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found on PATH")


@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("src", SOURCES, ids=lambda p: p.name)
def test_nvcc_compiles(src, arch, tmp_path):
    # -ftz=true as CuPy adds it; warnings are errors on both device and host side.
    cmd = [NVCC, "-std=c++17", f"-arch={arch}", "-ftz=true", "-Werror", "all-warnings",
           "-Xcompiler", "-Wall,-Wextra,-Werror", "-c", "-o", str(tmp_path / "k.o"), str(src)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def _find_nvrtc():
    cands = [os.environ.get("ZEROMPI_NVRTC_LIB", "")]
    for base in sys.path + [os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"]:
        for pat in ("nvidia/*/lib/libnvrtc.so*", "nvidia/*/*/lib/libnvrtc.so*",
                    "lib64/libnvrtc.so*"):
            cands += sorted(glob.glob(os.path.join(base, pat)))
    for c in cands:
        if c and "builtins" not in c and "alt" not in os.path.basename(c):
            try:  # preload the builtins beside it: NVRTC dlopens them by name
                for b in glob.glob(os.path.join(os.path.dirname(c), "libnvrtc-builtins.so*")):
                    if ".alt." not in b:
                        ctypes.CDLL(b, mode=ctypes.RTLD_GLOBAL)
                return ctypes.CDLL(c)
            except OSError:
                pass
    return None


@pytest.mark.parametrize("arch", ["compute_80", "sm_90"])
def test_nvrtc_compiles(arch):
    """Compile exactly what the loader hands CuPy, with CuPy's trailing -ftz=true."""
    lib = _find_nvrtc()
    if lib is None:
        pytest.skip("libnvrtc not found (pip install nvidia-cuda-nvrtc, or set ZEROMPI_NVRTC_LIB)")
    for src in SOURCES:
        prog = ctypes.c_void_p()
        code = _loader.load_source(src.name).encode()
        name = src.name.encode()
        assert lib.nvrtcCreateProgram(ctypes.byref(prog), code, name, 0, None, None) == 0
        opts = [o.encode() for o in
                (*_loader.COMPILE_OPTIONS, f"--gpu-architecture={arch}", "-ftz=true")]
        rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
        text = log.value.decode(errors="replace")
        assert rc == 0 and "warning" not in text, f"{src.name}: {text}"


# ------------------------------------------------------------------- GPU

def _cupy():
    cp = pytest.importorskip("cupy", reason="cupy is not installed")
    try:
        count = cp.cuda.runtime.getDeviceCount()
    except Exception as e:  # no driver / no device
        pytest.skip(f"no usable CUDA device: {e}")
    if count < 1:
        pytest.skip("no CUDA device")
    return cp


def _on_device(cp, host, off):
    """Copy of ``host`` as a view starting ``off`` elements into a fresh buffer."""
    buf = cp.zeros(host.size + 8, dtype=host.dtype)
    view = buf[off:off + host.size]
    view[...] = cp.asarray(host)
    return view


@pytest.mark.parametrize("gtag", TAGS)
def test_gpu_adamw_matches_reference(gtag):
    cp = _cupy()
    rng = np.random.default_rng(31)
    for hp in HPARAMS[:2]:
        for otag in ("none", "bf16", "f16"):
            for n in SIZES:
                for offs in OFFSETS:
                    master, m, v, g = adamw_inputs(n, gtag, rng)
                    dev = [_on_device(cp, a, o) for a, o in zip((master, m, v, g), offs)]
                    out = None
                    if otag != "none":
                        out = _on_device(cp, encode(np.zeros(n, np.float32), otag), offs[4])
                    kadamw.adamw_step(*dev, out, step=3, grad_coef=0.5, **hp)
                    low = kadamw.adamw_reference(master, m, v, g, None if otag == "none" else otag,
                                                 step=3, grad_coef=0.5, **hp)
                    what = f"{gtag}->{otag} n={n} offs={offs}"
                    names = ("param", "exp_avg", "exp_avg_sq")
                    for d, want, name in zip(dev, (master, m, v), names):
                        assert_same(d.get(), want, f"{what} {name}")
                    if out is not None:
                        assert_same(out.get(), low, f"{what} out")


def test_gpu_cast_and_scaled_copy_match_reference():
    cp = _cupy()
    rng = np.random.default_rng(32)
    for n in SIZES:
        for offs in ((0, 0), (1, 1), (3, 3), (2, 0)):
            x32 = make_grad(n, rng) * np.float32(1e3)
            for src, dst in (("f32", "bf16"), ("f32", "f16"), ("bf16", "f32"), ("f16", "f32")):
                x = encode(x32, src)
                d_out = _on_device(cp, encode(np.zeros(n, np.float32), dst), offs[1])
                kcast.cast_into(_on_device(cp, x, offs[0]), d_out)
                assert_same(d_out.get(), kcast.cast_reference(x, dst),
                            f"cast {src}->{dst} n={n} {offs}")
            for src in TAGS:
                for acc in (False, True):
                    x = encode(x32, src)
                    out0 = rng.standard_normal(n).astype(np.float32)
                    d_out = _on_device(cp, out0, offs[1])
                    kcast.scaled_copy(_on_device(cp, x, offs[0]), d_out, 3.0e-3, acc)
                    want = kcast.scaled_copy_reference(x, out0.copy(), 3.0e-3, acc)
                    assert_same(d_out.get(), want, f"scaled {src} acc={acc} n={n} {offs}")


@pytest.mark.parametrize("tag", TAGS)
def test_gpu_grad_stats_matches_reference(tag):
    cp = _cupy()
    rng = np.random.default_rng(33)
    for n in SIZES + (3_000_001,):
        for off in (0, 1, 3):
            for special in (None, np.inf, np.nan):
                x32 = make_grad(n, rng, specials=False)
                if special is not None and n:
                    x32[n - 1] = special
                x = encode(x32, tag)
                d = _on_device(cp, x, off)
                s1, f1 = kstats.compute_grad_stats(d)
                s2, f2 = kstats.compute_grad_stats(d)
                want, ovf = kstats.grad_stats_reference(x, exact_order=True)
                got = float(s1.get()[0])
                assert got == want or (np.isnan(got) and np.isnan(want)), (tag, n, off, got, want)
                assert bool(f1.get()[0]) == ovf, (tag, n, off)
                assert s1.get().tobytes() == s2.get().tobytes()  # deterministic
                assert int(f2.get()[0]) == int(f1.get()[0])


def test_gpu_checks_and_bf16_as_int16():
    cp = _cupy()
    a = cp.zeros(10, cp.float32)
    with pytest.raises(ValueError, match="exp_avg must be C-contiguous"):
        kadamw.adamw_step(a, cp.zeros(20, cp.float32)[::2], cp.zeros(10, cp.float32),
                          cp.zeros(10, cp.float32), step=1, **HPARAMS[0])
    with pytest.raises(ValueError, match="grad has 9 elements"):
        kadamw.adamw_step(a, cp.zeros(10, cp.float32), cp.zeros(10, cp.float32),
                          cp.zeros(9, cp.float32), step=1, **HPARAMS[0])
    with pytest.raises(ValueError, match="overlap"):
        kadamw.adamw_step(a, a, cp.zeros(10, cp.float32), cp.zeros(10, cp.float32), step=1,
                          **HPARAMS[0])
    x = float32_to_bf16_bits(np.linspace(-3, 3, 11, dtype=np.float32))
    out = cp.zeros(11, cp.float32)
    kcast.cast_into(cp.asarray(x.view(np.int16)), out)  # torch bf16 viewed as int16
    assert_same(out.get(), bf16_bits_to_float32(x))
