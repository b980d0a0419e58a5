"""The segment-table kernels (cuda_src/adamw_table.cu) without a GPU: their
__host__ __device__ loop bodies compiled by nvcc as host code and run on the CPU
(bitwise vs the numpy references of zerompi/kernels/adamw_table.py), and the table
builder's rules. nvcc/NVRTC compiles of the file are in test_kernels_build.py."""
from __future__ import annotations

import subprocess

import numpy as np
import pytest

from zerompi.kernels import adamw_table as kt
from zerompi.kernels.cast import to_float32

from kernel_inputs import (CUDA_SRC, NVCC, TAGS, assert_same, build_host_harness, encode, make_grad,
                           table_inputs)

HARNESS_CU = r"""
// Emulates B blocks of T threads running the table kernels' loop bodies, one after
// another; the 256-thread tree is the kernels' zm_block_sum, level by level.
#include "adamw_table.cu"
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

static std::vector<unsigned char> slurp(const std::string& path) {
  std::vector<unsigned char> b; FILE* f = fopen(path.c_str(), "rb"); if (!f) exit(2);
  int c; while ((c = fgetc(f)) != EOF) b.push_back((unsigned char)c);
  fclose(f); return b;
}
static void dump(const std::string& path, const void* p, size_t nbytes) {
  FILE* f = fopen(path.c_str(), "wb"); if (!f) exit(3);
  fwrite(p, 1, nbytes, f); fclose(f);
}
// File contents at element offset `off` of a 64-byte aligned block (misaligned bases).
struct Buf {
  std::vector<unsigned char> raw; unsigned char* p; size_t n;
  Buf(const std::string& path, size_t elt, size_t off) {
    std::vector<unsigned char> d = slurp(path);
    raw.resize(d.size() + elt * off + 128); n = d.size();
    p = (unsigned char*)(((unsigned long long)raw.data() + 63) & ~63ull) + elt * off;
    for (size_t i = 0; i < n; ++i) p[i] = d[i];
  }
};
static double tree(double* sh) {  // zm_block_sum's order
  for (unsigned s = ZM_STATS_THREADS / 2; s > 0; s >>= 1)
    for (unsigned t = 0; t < s; ++t) sh[t] += sh[t + s];
  return sh[0];
}

template <class G, class O> static int adamw(char** a) {
  std::string d = a[0];
  usize B = strtoull(a[1], 0, 10), T = strtoull(a[2], 0, 10);
  Buf p(d + "/master.bin", 4, atoi(a[3])), m(d + "/exp_avg.bin", 4, atoi(a[4]));
  Buf v(d + "/exp_avg_sq.bin", 4, atoi(a[5]));
  Buf g(d + "/grad.bin", sizeof(typename G::storage), atoi(a[6]));
  Buf o(d + "/out.bin", 2, atoi(a[7]));
  Buf segs(d + "/segs.bin", 8, 0), tiles(d + "/tiles.bin", 8, 0), rows(d + "/rows.bin", 4, 0);
  Buf coef(d + "/coef.bin", 4, 0);  // empty file: no device coefficient
  usize ntiles = tiles.n / (8 * ZM_TILE_COLS);
  for (usize b = 0; b < B; ++b)
    for (usize tile = b; tile < ntiles; tile += B)
      for (usize t = 0; t < T; ++t)
        adamw_tile<G, O>((float*)p.p, (float*)m.p, (float*)v.p, (const typename G::storage*)g.p,
                         O::present ? (typename O::storage*)o.p : 0, (const long long*)segs.p,
                         (const long long*)tiles.p, (const float*)rows.p,
                         coef.n ? (const float*)coef.p : 0, tile, t, T);
  dump(d + "/master.out", p.p, p.n); dump(d + "/exp_avg.out", m.p, m.n);
  dump(d + "/exp_avg_sq.out", v.p, v.n); dump(d + "/out.out", o.p, o.n);
  return 0;
}

template <class G> static int stats(char** a) {
  std::string d = a[0];
  Buf g(d + "/grad.bin", sizeof(typename G::storage), atoi(a[1]));
  Buf segs(d + "/segs.bin", 8, 0), tiles(d + "/tiles.bin", 8, 0), w(d + "/weights.bin", 8, 0);
  const long long* tl = (const long long*)tiles.p;
  usize ntiles = tiles.n / (8 * ZM_TILE_COLS);
  std::vector<double> part(ntiles + 1);
  std::vector<int> flag(ntiles + 1);
  double sh[ZM_STATS_THREADS];
  for (usize tile = 0; tile < ntiles; ++tile) {
    int bad = 0;
    for (usize t = 0; t < ZM_STATS_THREADS; ++t) {
      sh[t] = 0.0;
      stats_tile_thread<G>((const typename G::storage*)g.p, (const long long*)segs.p, tl, tile,
                           t, sh[t], bad);
    }
    part[tile] = stats_tile_part(tree(sh), tl, (const double*)w.p, tile);
    flag[tile] = bad != 0;
  }
  int bad = 0;
  for (usize t = 0; t < ZM_STATS_THREADS; ++t) {
    sh[t] = 0.0;
    stats_finish_thread(part.data(), flag.data(), ntiles, t, sh[t], bad);
  }
  double res[2] = {stats_result(tree(sh), bad), (double)(bad != 0)};
  dump(d + "/result.out", res, sizeof res);
  dump(d + "/parts.out", part.data(), 8 * ntiles);
  return 0;
}

#define ZM_ON(S, TAG, CALL) if (std::string(S) == TAG) return CALL;
int main(int argc, char** argv) {
  if (argc < 4) return 1;
  std::string op = argv[1];
  const char *x = argv[2], *y = argv[3];
  char** a = argv + 4;
#define ZM_OUTS(G) ZM_ON(y, "none", (adamw<G, NoOut>(a))) ZM_ON(y, "bf16", (adamw<G, BF16>(a))) \
    ZM_ON(y, "f16", (adamw<G, F16>(a)))
  if (op == "adamw") {
    if (std::string(x) == "f32") { ZM_OUTS(F32) }
    if (std::string(x) == "bf16") { ZM_OUTS(BF16) }
    if (std::string(x) == "f16") { ZM_OUTS(F16) }
  }
  if (op == "stats") {
    ZM_ON(x, "f32", stats<F32>(a)) ZM_ON(x, "bf16", stats<BF16>(a)) ZM_ON(x, "f16", stats<F16>(a))
  }
  return 1;
}
"""


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    if NVCC is None:
        pytest.skip("nvcc not found on PATH")
    return build_host_harness(tmp_path_factory.mktemp("table_harness"), HARNESS_CU)


def _write(d, table, bufs, extra=()):
    (d / "segs.bin").write_bytes(table.segs.tobytes())
    (d / "tiles.bin").write_bytes(table.tiles.tobytes())
    for name, a in list(bufs.items()) + list(extra):
        (d / f"{name}.bin").write_bytes(b"" if a is None else a.tobytes())


# (blocks, threads per block, base misalignment of master, exp_avg, exp_avg_sq, grad, out)
LAUNCHES = [(3, 32, (0, 0, 0, 0, 0)), (1, 7, (1, 1, 1, 1, 1)), (50, 64, (0, 3, 1, 2, 3))]


# the device coefficient: none (the rows' grad_coef), one that replaces it, an overflow
COEFS = (None, np.array([0.37, 0.0], np.float32), np.array([2.0, 1.0], np.float32))


@pytest.mark.parametrize("gtag", TAGS)
def test_host_adamw_table_matches_reference(harness, gtag, tmp_path):
    rng = np.random.default_rng(41)
    for otag in ("none", "bf16", "f16"):
        for tile, (blocks, threads, offs), coef in zip((64, 8, 8192), LAUNCHES, COEFS):
            table, rows, bufs = table_inputs(rng, gtag, otag, tile=tile)
            assert table.ntiles > blocks or tile == 8192
            _write(tmp_path, table, bufs, [("rows", rows), ("coef", coef)])
            subprocess.run([harness, "adamw", gtag, otag, str(tmp_path), str(blocks), str(threads),
                            *map(str, offs)], check=True)
            want = {k: (None if a is None else a.copy()) for k, a in bufs.items()}
            kt.adamw_table_reference(want["master"], want["exp_avg"], want["exp_avg_sq"],
                                     want["grad"], want["out"], table, rows, coef=coef)
            if coef is not None and coef[1]:  # an overflowed step changes nothing
                assert all(a is None or want[k].tobytes() == a.tobytes() for k, a in bufs.items())
            elif coef is not None:  # the coefficient is used (not the rows')
                ref = {k: (None if a is None else a.copy()) for k, a in bufs.items()}
                kt.adamw_table_reference(ref["master"], ref["exp_avg"], ref["exp_avg_sq"],
                                         ref["grad"], ref["out"], table, rows)
                assert ref["master"].tobytes() != want["master"].tobytes()
            what = f"{gtag}->{otag} tile={tile} coef={coef}"
            for name in ("master", "exp_avg", "exp_avg_sq", "out"):
                if want[name] is not None:
                    got = np.fromfile(tmp_path / f"{name}.out", want[name].dtype)
                    assert_same(got, want[name], f"{what} {name}")
            # skipped segments (and gaps between segments) are untouched
            n, mo = table.segs[2, 0], table.segs[2, 1]
            assert_same(want["master"][mo:mo + n], bufs["master"][mo:mo + n], "skipped")


@pytest.mark.parametrize("gtag", TAGS)
def test_host_grad_stats_table_matches_reference(harness, gtag, tmp_path):
    rng = np.random.default_rng(42)
    for tile, special in ((64, None), (8, np.inf), (8192, np.nan), (64, "empty")):
        lengths = (0,) * 3 if special == "empty" else None
        kw = {} if lengths is None else {"lengths": lengths}
        table, _, bufs = table_inputs(rng, "f32", "none", tile=tile, **kw)
        scale = np.float32(1 if gtag == "f16" else 1e3)  # no fp16 overflow unless asked
        g32 = make_grad(bufs["grad"].size, rng, specials=False) * scale
        if special in (np.inf, np.nan):
            seg = table.segs[5]
            g32[seg[2] + seg[0] - 1] = special  # last element of a many-tile segment
        grad = encode(g32, gtag)
        weights = rng.choice([1.0, 0.5, 1 / 3, 0.0], table.nseg)
        _write(tmp_path, table, {"grad": grad, "weights": weights})
        subprocess.run([harness, "stats", gtag, "-", str(tmp_path), "3"], check=True)
        got_sum, got_flag = np.fromfile(tmp_path / "result.out", np.float64)
        want_sum, want_flag = kt.grad_stats_table_reference(grad, table, weights)
        assert (got_sum, bool(got_flag)) == (want_sum, want_flag), (gtag, tile, special)
        assert want_flag == (special in (np.inf, np.nan))
        if not want_flag:  # the order matters at this level, the value does not
            xs = to_float32(grad).astype(np.float64)
            exact = sum(w * np.sum(xs[o:o + n] ** 2) for (n, _, o, _, _), w in zip(table.segs, weights))
            assert got_sum == pytest.approx(exact, rel=1e-13, abs=0)


def test_build_table_tiles_and_bounds():
    t = kt.build_table([10, 0, 3, 17], [0, 10, 10, 13], [5, 0, 0, 0], [0, 1, 2, 3], tile=8)
    assert t.tiles.tolist() == [[0, 0, 8], [0, 8, 2], [2, 0, 3], [3, 0, 8], [3, 8, 8], [3, 16, 1]]
    assert t.segs[:, 4].tolist() == [0, 0, 0, 0]  # no out buffer
    kt.check_bounds(t, {"master": 30, "grad": 17, "exp_avg": 20, "out": None})
    with pytest.raises(ValueError, match="segment 3 ends at 30 in master, which has 29"):
        kt.check_bounds(t, {"master": 29})
    with pytest.raises(ValueError, match="multiple of 4"):
        kt.build_table([1], [0], [0], [0], tile=6)
    with pytest.raises(ValueError, match="negative"):
        kt.build_table([1], [-1], [0], [0])
    empty = kt.build_table([], [], [], [])
    assert empty.nseg == 0 and empty.ntiles == 0
    assert kt.grad_stats_table_reference(np.zeros(0, np.float32), empty, []) == (0.0, False)
    row = kt.step_row(None)
    assert row.dtype == np.float32 and not row.any()
    src = (CUDA_SRC / kt.SOURCE).read_text()  # the layouts the host and the kernels share
    for name, value in (("SEG", kt.SEG_COLS), ("TILE", kt.TILE_COLS), ("ROW", kt.ROW_COLS)):
        assert f"#define ZM_{name}_COLS {value}\n" in src
    assert len(kt.SCALAR_KEYS) + 1 == kt.ROW_COLS
