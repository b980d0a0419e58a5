"""fp32 <-> bf16/fp16 casts and scaled fp32 copies (cuda_src/cast.cu).

numpy has no bf16: bf16 arrays are uint16 bit patterns. The bit-level helpers
below do exactly what cuda_src/common.cuh does (RNE; NaN stays NaN with its sign
and top payload bits, quiet bit set; fp16 overflow -> inf).
"""
from __future__ import annotations

import numpy as np

from . import _loader

SOURCE = "cast.cu"
_DT = {"f32": np.float32, "f16": np.float16, "bf16": np.uint16}


def float32_to_bf16_bits(x) -> np.ndarray:
    u = np.asarray(x, dtype=np.float32).view(np.uint32)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    rounded = (u + (0x7FFF + ((u >> 16) & 1))) >> 16  # uint32 wrap cannot occur below NaN
    return np.where(nan, (u >> 16) | 0x0040, rounded).astype(np.uint16)


def bf16_bits_to_float32(b) -> np.ndarray:
    return (np.asarray(b).astype(np.uint16).astype(np.uint32) << 16).view(np.float32)


def float32_to_fp16_bits(x) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    u = x.view(np.uint32)
    sign = (u >> 16) & 0x8000
    a = u & 0x7FFFFFFF
    r = a - np.uint32(0x38000000)  # wraps where unused
    normal = (r + (0xFFF + ((r >> 13) & 1))) >> 13
    with np.errstate(all="ignore"):
        t = a.view(np.float32) + np.float32(0.5)  # RNE to a multiple of 2^-24
    sub = t.view(np.uint32) - np.uint32(0x3F000000)
    out = np.where(a >= 0x38800000, normal, sub)
    out = np.where(a >= 0x477FF000, 0x7C00, out)
    out = np.where(a > 0x7F800000, 0x7E00 | ((a >> 13) & 0x3FF), out)
    return (out | sign).astype(np.uint16)


def fp16_bits_to_float32(h) -> np.ndarray:
    h = np.asarray(h).astype(np.uint16).astype(np.uint32)
    sign = (h & 0x8000) << 16
    e = (h >> 10) & 0x1F
    m = h & 0x3FF
    normal = sign | ((e + 112) << 23) | (m << 13)
    sub = (m.astype(np.float32) * np.float32(2.0**-24)).view(np.uint32) | sign
    special = sign | 0x7F800000 | (m << 13)
    bits = np.where(e == 0x1F, special, np.where(e == 0, sub, normal))
    return bits.astype(np.uint32).view(np.float32)


def to_float32(arr, tag: str | None = None) -> np.ndarray:
    """Decode an f32 / fp16 / bf16-bits numpy array to float32 (exact)."""
    tag = tag or _loader.dtype_tag(arr.dtype)
    if tag == "f32":
        return np.asarray(arr, np.float32)
    if tag == "f16":
        return fp16_bits_to_float32(np.asarray(arr).view(np.uint16))
    if tag == "bf16":
        return bf16_bits_to_float32(arr)
    raise TypeError(f"unsupported dtype {arr.dtype}")


def from_float32(x: np.ndarray, tag: str) -> np.ndarray:
    """Round float32 to ``tag`` the way the kernels do (bf16 as uint16 bits)."""
    if tag == "f32":
        return np.asarray(x, np.float32).copy()
    if tag == "f16":
        return float32_to_fp16_bits(x).view(np.float16)
    if tag == "bf16":
        return float32_to_bf16_bits(x)
    raise ValueError(f"unknown dtype tag {tag!r}")


def cast_reference(src: np.ndarray, dst_tag: str) -> np.ndarray:
    """Reference for ``cast``: src f32 -> bf16/f16, or bf16/f16 -> f32."""
    return from_float32(to_float32(src), dst_tag)


def scaled_copy_reference(src: np.ndarray, dst: np.ndarray, scale: float = 1.0,
                          accumulate: bool = False) -> np.ndarray:
    """Reference for ``scaled_copy``: dst = src*scale (or dst += src*scale), in place."""
    with np.errstate(all="ignore"):
        y = to_float32(src) * np.float32(scale)
        dst[...] = dst + y if accumulate else y
    return dst


# ---- GPU entry points (cupy arrays) -------------------------------------------

def cast_into(src, dst) -> None:
    """dst = src rounded or widened; pairs f32->bf16, f32->f16, bf16->f32, f16->f32."""
    st = _loader.check_array("src", src, ("f32", "bf16", "f16"))
    dt = _loader.check_array("dst", dst, ("f32", "bf16", "f16"))
    if (st == "f32") == (dt == "f32"):
        raise TypeError(f"cast_into supports f32<->bf16/f16 only, got {src.dtype} -> {dst.dtype}")
    dev, n = _loader.check_same_device_and_size([("src", src), ("dst", dst)])
    _loader.check_no_overlap([("src", src), ("dst", dst)])
    _loader.launch(SOURCE, f"cast_{st}_{dt}", dev, n, (src, dst, np.int64(n)))


def scaled_copy(src, dst, scale: float = 1.0, accumulate: bool = False) -> None:
    """fp32 dst = src*scale, or dst += src*scale; src f32, bf16 bits or f16."""
    st = _loader.check_array("src", src, ("f32", "bf16", "f16"))
    _loader.check_array("dst", dst, ("f32",))
    dev, n = _loader.check_same_device_and_size([("src", src), ("dst", dst)])
    _loader.check_no_overlap([("src", src), ("dst", dst)])
    _loader.launch(SOURCE, f"scaled_copy_{st}", dev, n,
                   (src, dst, np.int64(n), np.float32(scale), np.int32(bool(accumulate))))
