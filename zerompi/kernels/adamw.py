"""Fused AdamW over a flat fp32 shard (cuda_src/adamw.cu) and its numpy reference.

Both compute, in fp32, what torch's single-tensor AdamW computes with torch's
vectorised CPU kernels (which fuse lerp and addcmul into FMAs), op for op; the one
difference is sqrt, correctly rounded here, up to 1 ulp off in torch's CPU build:
    g = grad * grad_coef
    p = p * (1 - lr*wd)
    m = fma(w, g - m, m)            if |w| < 0.5 else fma(w - 1, g - m, g),  w = 1 - beta1
    v = fma((1 - beta2) * g, g, v * beta2)
    p = p + (-(lr/bc1) * m) / (sqrt(v) / sqrt(bc2) + eps)
Python-float scalars are combined in float64 and rounded to fp32 once, as torch does.
"""
from __future__ import annotations

import numpy as np

from . import _loader
from .cast import from_float32, to_float32

SOURCE = "adamw.cu"
_OUT_TAGS = {None: None, "none": None, "bf16": "bf16", "bfloat16": "bf16",
             "fp16": "f16", "f16": "f16", "float16": "f16"}


def adamw_scalars(*, lr, beta1, beta2, eps, weight_decay, step, grad_coef=1.0) -> dict:
    """fp32 kernel scalars, rounded from float64 the way torch rounds them."""
    if step < 1:
        raise ValueError(f"step must be >= 1 (bias correction), got {step}")
    bc1 = 1 - beta1 ** float(step)
    bc2 = 1 - beta2 ** float(step)
    f = np.float32
    return {"grad_coef": f(grad_coef), "decay": f(1 - lr * weight_decay),
            "w1": f(1 - beta1), "beta2": f(beta2), "c2": f(1 - beta2),
            "neg_step": f(-(lr / bc1)), "bc2_sqrt": f(bc2 ** 0.5), "eps": f(eps)}


def fma32(a, b, c) -> np.ndarray:
    """Correctly rounded fp32 fused multiply-add.

    a*b is exact in float64; the float64 sum is made round-to-odd (TwoSum error
    nudges an even result one ulp towards the exact value), which makes the
    final rounding to fp32 correct (no double-rounding error).
    """
    a, b, c = (np.asarray(t, np.float32).astype(np.float64) for t in (a, b, c))
    with np.errstate(all="ignore"):
        p = a * b
        s = p + c
        bv = s - p
        err = (p - (s - bv)) + (c - bv)
        fix = (err != 0) & np.isfinite(s) & ((s.view(np.int64) & 1) == 0)
        s = np.where(fix, np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
        return s.astype(np.float32)


def adamw_reference(master, exp_avg, exp_avg_sq, grad, out_dtype=None, *, lr, beta1,
                    beta2, eps, weight_decay, step, grad_coef=1.0, fma=True, sqrt=np.sqrt):
    """Update fp32 numpy ``master``/``exp_avg``/``exp_avg_sq`` in place.

    ``grad``: float32, float16 or uint16 (bf16 bits). ``out_dtype``: None,
    "bf16" or "fp16"; returns the rounded copy of the new master (uint16 bits
    for bf16, float16 for fp16) or None. ``fma=False`` evaluates lerp/addcmul
    unfused, as torch's scalar (non-vectorised) CPU path does. ``sqrt``: fp32
    square root; the default is correctly rounded like the kernel's, while
    torch's CPU sqrt (MKL) can be 1 ulp off, so tests substitute it to compare
    with torch bit for bit.
    """
    s = adamw_scalars(lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                      weight_decay=weight_decay, step=step, grad_coef=grad_coef)
    return adamw_apply(master, exp_avg, exp_avg_sq, grad, s, out_dtype, fma=fma, sqrt=sqrt)


def adamw_apply(master, exp_avg, exp_avg_sq, grad, s, out_dtype=None, *, fma=True,
                sqrt=np.sqrt):
    """adamw_reference with its fp32 scalars ``s`` (adamw_scalars) already made."""
    tag = _OUT_TAGS[out_dtype]
    one = np.float32(1)
    with np.errstate(all="ignore"):
        g = to_float32(grad) * s["grad_coef"]
        p = master * s["decay"]
        m, v, w = exp_avg, exp_avg_sq, s["w1"]
        d = g - m
        if abs(w) < 0.5:
            m = fma32(w, d, m) if fma else m + w * d
        else:
            m = fma32(w - one, d, g) if fma else g - d * (one - w)
        v = v * s["beta2"]
        v = fma32(s["c2"] * g, g, v) if fma else v + (s["c2"] * g) * g
        denom = sqrt(v) / s["bc2_sqrt"] + s["eps"]
        p = p + (s["neg_step"] * m) / denom
    master[...], exp_avg[...], exp_avg_sq[...] = p, m, v
    return None if tag is None else from_float32(p, tag)


def check_adamw_arrays(master, exp_avg, exp_avg_sq, grad, out, out_name: str = "out"):
    """dtype checks shared by the AdamW launchers: (grad tag, out tag, [(name, array)])."""
    named = [("master", master), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)]
    for name, a in named:
        _loader.check_array(name, a, ("f32",))
    gt = _loader.check_array("grad", grad, ("f32", "bf16", "f16"))
    named.append(("grad", grad))
    ot = "none"
    if out is not None:
        ot = _loader.check_array(out_name, out, ("bf16", "f16"))
        named.append((out_name, out))
    return gt, ot, named


def adamw_step(master, exp_avg, exp_avg_sq, grad, out_param=None, *, lr, beta1, beta2,
               eps, weight_decay, step, grad_coef=1.0) -> None:
    """One fused AdamW step on cupy arrays, in place; launches on the current stream.

    master/exp_avg/exp_avg_sq: float32. grad: float32, float16 or uint16/int16
    (bf16 bits). out_param: None, float16 or uint16/int16 (bf16 bits); receives
    the new master rounded to nearest even.
    """
    gt, ot, named = check_adamw_arrays(master, exp_avg, exp_avg_sq, grad, out_param, "out_param")
    dev, n = _loader.check_same_device_and_size(named)
    _loader.check_no_overlap(named)
    s = adamw_scalars(lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                      weight_decay=weight_decay, step=step, grad_coef=grad_coef)
    out_arg = out_param if out_param is not None else np.uint64(0)  # NULL, unused
    args = (master, exp_avg, exp_avg_sq, grad, out_arg, np.int64(n), s["grad_coef"],
            s["decay"], s["w1"], s["beta2"], s["c2"], s["neg_step"], s["bc2_sqrt"], s["eps"])
    _loader.launch(SOURCE, f"adamw_{gt}_{ot}", dev, n, args)
