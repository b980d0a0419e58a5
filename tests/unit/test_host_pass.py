"""The offloaded optimizer's fused host pass (optim/host_pass.py, host_kernel.py and
cuda_src/host_adamw.cpp): the compiled pass bit for bit against the CUDA kernels' numpy
reference (every gradient/output dtype, skipped segments, padding, several tiles and
threads, subnormals and inf/nan), the work units, the torch kernel within a few ulps of
it, the step against ShardedAdamW, and the fallback when nothing compiles."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from zerompi.kernels import adamw_table as kt
from zerompi.kernels.adamw import adamw_apply, adamw_scalars
from zerompi.kernels.cast import from_float32
from zerompi.optim import ShardedAdamW, host_kernel
from zerompi.optim.adamw import Segment
from zerompi.optim.host_pass import HostPassAdamW, build_units

from kernel_inputs import HPARAMS, assert_same, make_grad

DT = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
NP = {"f32": np.float32, "bf16": np.uint16, "f16": np.float16}
LENGTHS = (37, 0, 1, 300, 7, 1023, 5, 129, 64, 3, 4000)


def compiled():
    if host_kernel.library() is None:
        pytest.skip(f"no compiled host pass here: {host_kernel.reason()}")


def shard(rng, lengths=LENGTHS):
    """Segments packed in random order with 0-2 element gaps (padding), and the size."""
    segs, pos = [None] * len(lengths), int(rng.integers(0, 3))
    for k in rng.permutation(len(lengths)):
        segs[k] = Segment(pos, pos, int(lengths[k]), k, 0, k % 2)
        pos += int(lengths[k]) + int(rng.integers(0, 3))
    return segs, pos + 2


def as_torch(a: np.ndarray, tag: str) -> torch.Tensor:
    t = torch.from_numpy(a.copy())
    return t.view(torch.bfloat16) if tag == "bf16" else t


def as_numpy(t: torch.Tensor, tag: str) -> np.ndarray:
    return t.view(torch.int16).numpy().view(np.uint16) if tag == "bf16" else t.numpy()


def reference(master, m, v, g, segs, rows, otag):
    """The numpy reference of one pass: AdamW where the row says so, then every
    element's output from the master (padding and skipped segments included)."""
    master, m, v = master.copy(), m.copy(), v.copy()
    for k, s in enumerate(segs):
        if rows[k, 8]:
            sl = slice(s.shard_lo, s.shard_lo + s.length)
            mp, mm, mv = master[sl].copy(), m[sl].copy(), v[sl].copy()
            adamw_apply(mp, mm, mv, g[sl], dict(zip(kt.SCALAR_KEYS, rows[k, :8])))
            master[sl], m[sl], v[sl] = mp, mm, mv
    return master, m, v, (None if otag == "none" else from_float32(master, otag))


def inputs(rng, gtag, otag, segs, n, specials=True):
    master = rng.standard_normal(n).astype(np.float32)
    m = (rng.standard_normal(n) * 0.1).astype(np.float32)
    v = (np.abs(rng.standard_normal(n)) * 1e-3).astype(np.float32)
    v[13] = np.float32(2e-42)  # a subnormal second moment
    g = from_float32(make_grad(n, rng, specials), gtag)
    rows = np.stack([kt.step_row(None if k in (2, 5) else adamw_scalars(
        step=1 + k % 4, grad_coef=(0.5, 1.0, 3e-3)[k % 3], **HPARAMS[k % len(HPARAMS)]))
        for k in range(len(segs))])
    return master, m, v, g, rows


@pytest.mark.parametrize("otag", ["bf16", "f16", "f32", "none"])
@pytest.mark.parametrize("gtag", ["f32", "bf16", "f16"])
def test_compiled_pass_is_the_reference_bit_for_bit(gtag, otag):
    compiled()
    rng = np.random.default_rng(7)
    segs, n = shard(rng)
    master, m, v, g, rows = inputs(rng, gtag, otag, segs, n)
    want = reference(master, m, v, g, segs, rows, otag)
    for threads, bounds in ((1, [0, n]), (3, [0, 100, 101, 2500, n])):
        units = build_units(segs, n, bounds, unit=256)
        tm, tmm, tv = (torch.from_numpy(a.copy()) for a in (master, m, v))
        out = None if otag == "none" else torch.zeros(n, dtype=DT[otag])
        job = host_kernel.launch(tm, tmm, tv, as_torch(g, gtag), out, units, rows, len(bounds) - 1, threads)
        for t in reversed(range(len(bounds) - 1)):  # waits in any order
            job.wait(t)
        job.join()
        for name, got, w in (("master", tm.numpy(), want[0]), ("exp_avg", tmm.numpy(), want[1]),
                             ("exp_avg_sq", tv.numpy(), want[2])):
            assert_same(got, w, f"{gtag}/{otag} threads {threads}: {name}")
        if out is not None:
            assert_same(as_numpy(out, otag), want[3], f"{gtag}/{otag} threads {threads}: out")


def test_units_cover_the_shard_cut_at_tiles_and_size():
    rng = np.random.default_rng(1)
    segs, n = shard(rng)
    bounds = [0, 50, 51, 3000, n]
    u = build_units(segs, n, bounds, unit=100)
    assert u[0, 0] == 0 and (u[1:, 0] == u[:-1, 0] + u[:-1, 1]).all() and u[-1, 0] + u[-1, 1] == n
    assert (u[:, 1] >= 1).all() and (u[:, 1] <= 100).all()
    for lo, length, k, t in u.tolist():  # inside one tile, inside its segment (or a gap)
        assert bounds[t] <= lo and lo + length <= bounds[t + 1]
        if k >= 0:
            s = segs[k]
            assert s.shard_lo <= lo and lo + length <= s.shard_lo + s.length
        else:
            assert not any(s.shard_lo < lo + length and lo < s.shard_lo + s.length for s in segs)
    assert sum(length for _, length, k, _ in u.tolist() if k >= 0) == sum(LENGTHS)
    with pytest.raises(ValueError, match="tile bounds"):
        build_units(segs, n, [0, n - 1])
    with pytest.raises(ValueError, match="overlaps"):
        build_units([Segment(0, 0, 5, 0, 0, 0), Segment(3, 3, 5, 1, 0, 0)], 10, [0, 10])


GROUPS = [dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01),
          dict(lr=0.05, betas=(0.3, 0.5), eps=1e-6, weight_decay=0.0)]


def _setup(gtag, seed=3):
    """(segments, size, host buffers, their views) of a random shard."""
    rng = np.random.default_rng(seed)
    segs, n = shard(rng)
    master, m, v, g, _ = inputs(rng, gtag, "bf16", segs, n, specials=False)
    bufs = {"master": torch.from_numpy(master), "exp_avg": torch.from_numpy(m),
            "exp_avg_sq": torch.from_numpy(v), "grad": [as_torch(g, gtag)],
            "out": [torch.zeros(n, dtype=torch.bfloat16)]}

    def views(shard_lo, flat_lo, length):
        sl = slice(shard_lo, shard_lo + length)
        return (bufs["master"][sl], bufs["grad"][0][sl], bufs["exp_avg"][sl], bufs["exp_avg_sq"][sl],
                bufs["out"][0][sl])
    return segs, n, bufs, views


def _optimizer(kernel, gtag, seed=3):
    segs, n, bufs, views = _setup(gtag, seed)
    groups = [dict(g) for g in GROUPS]
    return HostPassAdamW(segs, views, groups, len(segs), bufs=bufs, owned=n, bounds=[0, 700, n],
                         threads=2, kernel=kernel), bufs


@pytest.mark.parametrize("gtag", ["f32", "bf16"])
def test_torch_kernel_tracks_the_compiled_pass(gtag):
    """Skipped parameters, unscale x clip, an LR change between steps: the compiled pass
    and the torch kernel (torch's fused AdamW, a cast) within a few ulps of ShardedAdamW
    (torch's single-tensor ops) on the same state; the output is the master rounded."""
    compiled()
    runs = [_optimizer(k, gtag) for k in ("compiled", "torch")]
    segs, n, rbufs, views = _setup(gtag)
    ref = ShardedAdamW(segs, views, [dict(g) for g in GROUPS], len(segs))
    nseg = len(segs)
    for coef, used in ((1.0, None), (0.37, [True, False] + [True] * (nseg - 2)), (2.0 ** -7, None)):
        for opt in [o for o, _ in runs] + [ref]:
            opt.step(coef, used)
            opt.param_groups[1]["lr"] *= 0.5
    assert [o.kernel for o, _ in runs] == ["compiled", "torch"]
    assert runs[0][0].steps == ref.steps == [3, 2] + [3] * (nseg - 2)
    for name in ("master", "exp_avg", "exp_avg_sq"):
        want = rbufs[name]
        moved = (want - _setup(gtag)[2][name]).abs()
        assert moved.max() > 0, name  # the steps did something to compare
        tol = 8 * torch.finfo(torch.float32).eps * (want.abs() + 0.05)
        for _, bufs in runs:
            assert torch.all((bufs[name] - want).abs() <= tol), name
    for _, bufs in runs:
        assert torch.equal(bufs["out"][0], bufs["master"].to(torch.bfloat16))


def test_without_a_compiler_the_torch_kernel_runs_and_says_why(monkeypatch, tmp_path):
    monkeypatch.setattr(host_kernel, "_state", {})
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("ZEROMPI_CACHE_DIR", str(tmp_path))
    opt, _ = _optimizer("auto", "bf16")
    assert opt.kernel == "torch" and "no C++ compiler" in opt.fallback_reason
    opt.step(0.5)  # runs
    with pytest.raises(RuntimeError, match=r"offload.host_pass = compiled: .*no C\+\+ compiler"):
        _optimizer("compiled", "bf16")


def test_launch_checks_its_buffers():
    compiled()
    z = torch.zeros(10)
    units = np.array([[0, 10, -1, 0]], np.int64)
    rows = np.zeros((1, kt.ROW_COLS), np.float32)
    with pytest.raises(ValueError, match="exp_avg must be float32"):
        host_kernel.launch(z, z.double(), z, z, None, units, rows, 1, 1)
    with pytest.raises(ValueError, match="grad has 5 elements; the units reach 10"):
        host_kernel.launch(z, z, z, z[:5], None, units, rows, 1, 1)
    with pytest.raises(ValueError, match="a unit names a tile"):
        host_kernel.launch(z, z, z, z, None, units, rows, 0, 1)


def test_host_zeros_registers_pages_for_the_gpu(cuda):
    from zerompi.zero.pinned import host_zeros

    t = host_zeros(1000, torch.bfloat16, pin=True)
    assert t.is_pinned() and t.numel() == 1000 and not t.float().any()
    d = torch.arange(1000, device="cuda").to(torch.bfloat16)
    t.copy_(d, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(t, d.cpu())
    assert not host_zeros(10, torch.float32, pin=False).is_pinned()
