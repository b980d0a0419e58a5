"""Run-time compilation of ``cuda_src/*.cu`` with CuPy (NVRTC), plus argument checks.

CuPy is imported lazily so that the package imports on machines without it.
"""
from __future__ import annotations

import os
import re
import threading
from pathlib import Path

import numpy as np

COMPILE_OPTIONS = ("--std=c++17",)
THREADS = 256  # block size for every elementwise launch
MAX_BLOCKS = 8192  # grid-stride loops cover the rest

_INCLUDE_RE = re.compile(r'^[ \t]*#[ \t]*include[ \t]+"([^"]+)"[ \t]*$', re.M)
_PRAGMA_ONCE_RE = re.compile(r"^[ \t]*#[ \t]*pragma[ \t]+once[ \t]*$", re.M)


def cuda_src_dir() -> Path:
    """Directory holding the .cu sources.

    Looked up, in order: $ZEROMPI_CUDA_SRC; ``zerompi/cuda_src`` or
    ``zerompi/kernels/cuda_src`` (package data of an installed copy);
    ``<repo>/cuda_src`` (source checkout).
    """
    here = Path(__file__).resolve().parent
    candidates = [here.parent / "cuda_src", here / "cuda_src", here.parents[1] / "cuda_src"]
    env = os.environ.get("ZEROMPI_CUDA_SRC")
    if env:
        candidates.insert(0, Path(env))
    for c in candidates:
        if (c / "common.cuh").is_file():
            return c
    raise FileNotFoundError(
        "zerompi CUDA sources not found; looked in: " + ", ".join(map(str, candidates)))


def load_source(name: str) -> str:
    """Source text of ``name`` with local ``#include "..."`` files inlined.

    Inlining (rather than ``-I``) makes the text self-contained, so CuPy's
    on-disk cache, keyed on the source text, sees header edits too.
    """
    root = cuda_src_dir()
    seen: set[str] = set()

    def expand(fname: str) -> str:
        text = (root / fname).read_text()
        out, pos = [], 0
        for m in _INCLUDE_RE.finditer(text):
            inc = m.group(1)
            line = text.count("\n", 0, m.end()) + 2  # line after the include
            out.append(text[pos:m.start()])
            if inc not in seen:
                seen.add(inc)
                body = _PRAGMA_ONCE_RE.sub("", expand(inc))
                out.append(f'#line 1 "{inc}"\n{body}\n#line {line} "{fname}"')
            pos = m.end()
        out.append(text[pos:])
        return "".join(out)

    seen.add(name)
    return expand(name)


_lock = threading.Lock()
_modules: dict = {}
_functions: dict = {}


def get_kernel(source: str, kernel: str, device_id: int):
    """``cupy.RawKernel`` for ``kernel`` in ``source``, compiled once per device."""
    key = (source, kernel, device_id)
    fn = _functions.get(key)
    if fn is not None:
        return fn
    import cupy

    with _lock, cupy.cuda.Device(device_id):
        mod = _modules.get((source, device_id))
        if mod is None:
            # A RawModule binds to the device current at first use: one per device.
            mod = cupy.RawModule(code=load_source(source), options=COMPILE_OPTIONS)
            _modules[(source, device_id)] = mod
        fn = _functions[key] = mod.get_function(kernel)
    return fn


def launch(source: str, kernel: str, device_id: int, n: int, args: tuple,
           blocks: int | None = None, threads: int = THREADS) -> None:
    """Launch on CuPy's current stream of ``device_id``."""
    import cupy

    if blocks is None:
        blocks = max(1, min(-(-n // (threads * 4)), MAX_BLOCKS))
    fn = get_kernel(source, kernel, device_id)
    with cupy.cuda.Device(device_id):
        fn((blocks,), (threads,), args)


# ---- dtype tags and argument checks ------------------------------------------
# bf16 has no numpy/cupy dtype: bf16 data travels as uint16 (or int16) bit patterns,
# e.g. torch: cupy.from_dlpack(t.view(torch.int16)).

def dtype_tag(dtype) -> str | None:
    try:
        name = np.dtype(dtype).name
    except TypeError:
        name = str(dtype)
    if name == "float32":
        return "f32"
    if name == "float16":
        return "f16"
    if name in ("uint16", "int16", "bfloat16"):
        return "bf16"
    return None


def check_array(name: str, arr, allowed: tuple[str, ...]) -> str:
    """Validate a device array argument; returns its dtype tag."""
    ptr = getattr(getattr(arr, "data", None), "ptr", None)
    if not isinstance(ptr, int) or not hasattr(arr, "device") or not hasattr(arr, "flags"):
        raise TypeError(f"{name} must be a cupy.ndarray, got {type(arr).__name__}")
    tag = dtype_tag(arr.dtype)
    if tag not in allowed:
        want = ", ".join({"f32": "float32", "f16": "float16",
                          "bf16": "uint16/int16 (bf16 bits)"}[t] for t in allowed)
        raise TypeError(f"{name} has dtype {arr.dtype}; expected {want}")
    if not arr.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous")
    if arr.size and ptr % arr.itemsize:
        raise ValueError(f"{name} data pointer is not aligned to its element size")
    return tag


def check_same_device_and_size(named: list[tuple[str, object]]) -> tuple[int, int]:
    """All arrays on one device with one element count; returns (device_id, n)."""
    name0, a0 = named[0]
    dev, n = a0.device.id, a0.size
    for name, a in named[1:]:
        if a.device.id != dev:
            raise ValueError(f"{name} is on device {a.device.id} but {name0} is on device {dev}")
        if a.size != n:
            raise ValueError(f"{name} has {a.size} elements but {name0} has {n}")
    return dev, n


def check_no_overlap(named: list[tuple[str, object]]) -> None:
    """Kernels stream through their buffers; aliased buffers would corrupt results."""
    spans = [(a.data.ptr, a.data.ptr + a.nbytes, name) for name, a in named if a.nbytes]
    spans.sort()
    for (s0, e0, n0), (s1, _, n1) in zip(spans, spans[1:]):
        if s1 < e0:
            raise ValueError(f"{n0} and {n1} overlap in memory")
