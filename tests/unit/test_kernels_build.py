"""The CUDA sources build and compute right without a GPU: the kernels' loop bodies compiled
by nvcc as host code and run on the CPU (bitwise vs the references), and every
cuda_src/*.cu compiled by nvcc (sm_80, sm_90) and by NVRTC as CuPy will."""
from __future__ import annotations

import ctypes
import glob
import os
import subprocess
import sys

import numpy as np
import pytest

from zerompi.kernels import _loader
from zerompi.kernels import adamw as kadamw
from zerompi.kernels import cast as kcast

from kernel_inputs import (HPARAMS, NVCC, OFFSETS, SIZES, SOURCES, TAGS, adamw_inputs, assert_same,
                           build_host_harness, encode, make_grad)

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


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    if NVCC is None:
        pytest.skip("nvcc not found on PATH")
    return build_host_harness(tmp_path_factory.mktemp("harness"), HARNESS_CU)


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
@pytest.mark.parametrize("src", SOURCES, ids=lambda p: p.name)
def test_nvcc_compiles(src, tmp_path):
    # sm_80 and sm_90 in one run: nvcc compiles the device code once per architecture
    # and the host side once (two runs did the host side twice: ~40% of the CPU time).
    # -ftz=true as CuPy adds it; warnings are errors on both device and host side.
    cmd = [NVCC, "-std=c++17", "-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90,code=sm_90",
           "-ftz=true", "-Werror", "all-warnings",
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
