"""The offloaded optimizer's host pass as a compiled kernel (cuda_src/host_adamw.cpp).

One pass over the host shard reads the gradient in its own dtype (bf16: 2 bytes), the
fp32 master and moments, and writes them back with the low-precision copy for the device
(~28 bytes per element in bf16): unscale x clip, AdamW and the cast in one go, with the
CUDA kernels' element arithmetic (adamw.cuh), hence bit for bit their numpy reference.

It is compiled with the host's C++ compiler (g++, or $CXX) at first use, for this CPU
(-march=native), and cached under $ZEROMPI_CACHE_DIR (default ~/.cache/zerompi), keyed on
the sources, the compiler and the CPU; ranks compiling at once each write a temporary
file and rename it. When no compiler works, `library()` is None and `reason()` says why:
the optimizer then runs torch's fused AdamW and a cast instead (host_pass.py).
The pass runs on its own std::threads; ctypes releases the GIL for every call.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import numpy as np
import torch

from ..kernels._loader import cuda_src_dir

SOURCE = "host_adamw.cpp"
HEADERS = ("adamw.cuh", "common.cuh")
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fno-strict-aliasing",
         "-std=c++17", "-shared", "-fPIC", "-pthread")
TAGS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
NO_OUT = 3
UNIT_COLS = 4  # shard offset, length, segment (-1: padding), upload tile
_lock = threading.Lock()
_state: dict = {}


def cache_dir() -> Path:
    env = os.environ.get("ZEROMPI_CACHE_DIR")
    base = Path(env) if env else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "zerompi"
    return base / "host_pass"


def _cpu_key() -> str:
    """-march=native code runs on this CPU model only: the key names its features."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return platform.machine() + ":" + hashlib.sha256(flags.encode()).hexdigest()[:12]


def _build(cxx: str) -> Path:
    src = cuda_src_dir()
    text = b"".join((src / n).read_bytes() for n in (SOURCE, *HEADERS))
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256(text + version.encode() + " ".join(FLAGS).encode() + _cpu_key().encode()).hexdigest()[:20]
    out = cache_dir() / f"host_adamw-{key}.so"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        r = subprocess.run([cxx, *FLAGS, f"-I{src}", str(src / SOURCE), "-o", tmp],
                           capture_output=True, text=True, timeout=300)
        if r.returncode != 0:
            raise RuntimeError(f"{cxx} failed: {(r.stderr or r.stdout).strip()[-600:]}")
        os.replace(tmp, out)  # atomic: a rank compiling at the same time finds a whole file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def library():
    """The compiled kernel (a ctypes.CDLL), built on first call; None if it cannot be."""
    with _lock:
        if "lib" in _state:
            return _state["lib"]
        lib, why = None, None
        cxx = os.environ.get("CXX") or "g++"
        try:
            if shutil.which(cxx) is None:
                raise RuntimeError(f"no C++ compiler: {cxx!r} is not on PATH (set CXX)")
            lib = ctypes.CDLL(str(_build(cxx)))  # CDLL: the GIL is released in every call
            p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
            lib.hp_launch.restype = p
            lib.hp_launch.argtypes = [p, p, p, p, p, i32, i32, p, i64, p, i64, i32]
            lib.hp_wait.argtypes = [p, i64]
            lib.hp_join.argtypes = [p]
            lib.hp_join.restype = ctypes.c_double
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            lib, why = None, f"{type(e).__name__}: {e}"
        _state["lib"], _state["reason"] = lib, why
        return lib


def reason() -> str | None:
    """Why library() is None (None when it loaded, or was never asked for)."""
    return _state.get("reason")


def _ptr(t: torch.Tensor | None) -> int | None:
    if t is None:
        return None
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(f"the host pass needs contiguous host tensors, got one on {t.device}")
    return t.data_ptr()


class Job:
    """A pass started on its own threads: wait(tile) blocks until that upload tile is
    written (the GIL released), join() until all is, and frees it; `seconds` is then the
    pass's own time (launch to its last tile). Holds the tables meanwhile."""

    def __init__(self, lib, handle, keep):
        self.lib, self.handle, self.keep = lib, handle, keep
        self.seconds = None

    def wait(self, tile: int) -> None:
        self.lib.hp_wait(self.handle, tile)

    def join(self) -> None:
        if self.handle is not None:
            self.seconds = self.lib.hp_join(self.handle)
            self.handle, self.keep = None, None

    def __del__(self):
        self.join()


def launch(master, exp_avg, exp_avg_sq, grad, out, units: np.ndarray, rows: np.ndarray,
           ntiles: int, threads: int) -> Job:
    """Start the pass over `units` (int64 [n, 4]) with per-segment scalar rows (float32
    [nseg, 9], kernels/adamw_table.step_row); buffers are shard-indexed host tensors
    (fp32 master and moments; grad fp32/bf16/fp16; out fp32/bf16/fp16 or None). The
    units must lie inside every buffer (HostPassAdamW builds them so)."""
    lib = library()
    if lib is None:
        raise RuntimeError(f"the compiled host pass is unavailable: {reason()}")
    for name, t in (("master", master), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if t.dtype != torch.float32:
            raise ValueError(f"{name} must be float32, got {t.dtype}")
    if grad.dtype not in TAGS or (out is not None and out.dtype not in TAGS):
        raise ValueError(f"gradient {grad.dtype} / output {None if out is None else out.dtype}: "
                         "float32, bfloat16 or float16")
    units = np.ascontiguousarray(units, np.int64)
    rows = np.ascontiguousarray(rows, np.float32)
    end = int((units[:, 0] + units[:, 1]).max(initial=0))
    for name, t in (("master", master), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq),
                    ("grad", grad), ("out", out)):
        if t is not None and t.numel() < end:
            raise ValueError(f"{name} has {t.numel()} elements; the units reach {end}")
    if units.size and (units[:, 3].min() < 0 or units[:, 3].max() >= ntiles or units[:, 2].max() >= len(rows)):
        raise ValueError("a unit names a tile or a segment row that does not exist")
    h = lib.hp_launch(_ptr(master), _ptr(exp_avg), _ptr(exp_avg_sq), _ptr(grad), _ptr(out),
                      TAGS[grad.dtype], NO_OUT if out is None else TAGS[out.dtype],
                      units.ctypes.data, units.shape[0], rows.ctypes.data, ntiles, max(1, int(threads)))
    if not h:
        raise RuntimeError("hp_launch refused its arguments")
    return Job(lib, h, (units, rows, master, exp_avg, exp_avg_sq, grad, out))
