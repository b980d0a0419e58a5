"""Kernel references and argument checks (no GPU needed): numpy references vs torch and
numpy, and the Python loaders' checks before any launch."""
from __future__ import annotations

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

from kernel_inputs import SOURCES, TAGS, HPARAMS, assert_same, encode, make_grad, adamw_inputs

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
