"""On a GPU: every kernel against its numpy reference (skips where there is none)."""
from __future__ import annotations


import numpy as np
import pytest

from zerompi.kernels import adamw as kadamw
from zerompi.kernels import adamw_table as kt
from zerompi.kernels import cast as kcast
from zerompi.kernels import grad_stats as kstats
from zerompi.kernels.cast import (bf16_bits_to_float32, float32_to_bf16_bits)

from kernel_inputs import (HPARAMS, OFFSETS, SIZES, TAGS, adamw_inputs, assert_same, encode, make_grad,
                           table_inputs)

pytestmark = pytest.mark.usefixtures("cuda")  # skips without a CUDA device; cupy: _cupy()

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


# ------------------------------------------------ segment tables (adamw_table.cu)

def _table_on_device(cp, table, rows, bufs, offs):
    dev = {k: None if a is None else _on_device(cp, a, o) for (k, a), o in zip(bufs.items(), offs)}
    return dev, cp.asarray(table.segs), cp.asarray(table.tiles), cp.asarray(rows)


@pytest.mark.parametrize("gtag", TAGS)
def test_gpu_adamw_table_matches_reference(gtag):
    cp = _cupy()
    rng = np.random.default_rng(43)
    for otag in ("none", "bf16", "f16"):
        # the device coefficient: none, one that replaces the rows' grad_coef, an overflow
        coefs = (None, np.array([0.37, 0.0], np.float32), np.array([2.0, 1.0], np.float32))
        for (tile, offs), coef in zip(((64, (0,) * 5), (8, (1, 3, 2, 1, 3)), (8192, (0,) * 5)), coefs):
            table, rows, bufs = table_inputs(rng, gtag, otag, tile=tile)
            dev, segs, tiles, drows = _table_on_device(cp, table, rows, bufs, offs)
            kt.adamw_table_step(dev["master"], dev["exp_avg"], dev["exp_avg_sq"], dev["grad"],
                                dev["out"], segs, tiles, drows, None if coef is None else cp.asarray(coef))
            kt.adamw_table_reference(bufs["master"], bufs["exp_avg"], bufs["exp_avg_sq"],
                                     bufs["grad"], bufs["out"], table, rows, coef=coef)
            for name, want in bufs.items():
                if want is not None:
                    assert_same(dev[name].get(), want, f"{gtag}->{otag} tile={tile} {name} coef={coef}")


@pytest.mark.parametrize("tag", TAGS)
def test_gpu_grad_stats_table_matches_reference(tag):
    cp = _cupy()
    rng = np.random.default_rng(44)
    for tile, special in ((64, None), (8, np.inf), (8192, None), (8192, np.nan)):
        table, _, bufs = table_inputs(rng, "f32", "none", tile=tile)
        scale = np.float32(1 if tag == "f16" else 1e3)
        g32 = make_grad(bufs["grad"].size, rng, specials=False) * scale
        if special is not None:
            g32[table.segs[5, 2]] = special
        grad = encode(g32, tag)
        weights = rng.choice([1.0, 0.5, 1 / 3, 0.0], table.nseg)
        d = _on_device(cp, grad, 1)
        args = (cp.asarray(table.segs), cp.asarray(table.tiles), cp.asarray(weights))
        got = []
        for _ in range(2):  # deterministic
            out = (cp.zeros(1, np.float64), cp.zeros(1, np.int32))
            kt.grad_stats_table(d, *args, out)
            got.append((float(out[0].get()[0]), bool(out[1].get()[0])))
        assert got[0] == got[1] == kt.grad_stats_table_reference(grad, table, weights), (tag, tile)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_gpu_fused_adamw_matches_sharded_and_reference(stage):
    """FusedShardAdamW on CUDA ShardStates (CuPy executor, a side stream) vs the numpy
    executor on host copies (bitwise) and ShardedAdamW on CUDA (torch's CUDA ops)."""
    _cupy()
    import torch
    from zerompi.optim import ShardedAdamW
    from zerompi.optim.fused_adamw import CupyExecutor, FusedShardAdamW, NumpyExecutor
    from shard_states import DTYPES, NUMELS, make_state, param_groups, set_grads

    for dtypes in DTYPES:
        (gpu, segs), (ref, _), (host, _) = (make_state(stage, *dtypes, device=d)
                                            for d in ("cuda", "cuda", "cpu"))
        fused = FusedShardAdamW(segs, gpu, param_groups(), len(NUMELS), tile=32)
        assert isinstance(fused.executor, CupyExecutor)
        sharded = ShardedAdamW(segs, ref.views, param_groups(), len(NUMELS))
        numpy_ = FusedShardAdamW(segs, host, param_groups(), len(NUMELS), NumpyExecutor(), tile=32)
        side = torch.cuda.Stream()
        for k, (coef, used) in enumerate([(1.0, None), (0.37, [True, False] + [True] * 5)]):
            set_grads([gpu, ref, host], seed=20 + k)
            w = [1.0 if s.param % 2 else 0.5 for s in segs]
            torch.cuda.synchronize()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                torch.cuda.set_sync_debug_mode("error")  # a torch-side sync raises
                try:
                    norm = fused.grad_sq_norm(w)
                    fused.step(coef, used)
                finally:
                    torch.cuda.set_sync_debug_mode(0)
            side.synchronize()
            assert norm.is_cuda and norm.dtype == torch.float64 and norm.dim() == 0
            assert float(norm) == float(numpy_.grad_sq_norm(w))
            assert float(norm) == pytest.approx(float(sharded.grad_sq_norm(w)), rel=1e-12)
            sharded.step(coef, used)
            numpy_.step(coef, used)
        for name, t in host.buffers().items():
            g, r = gpu.buffers()[name].cpu(), ref.buffers()[name].cpu()
            as_np = ((lambda x: x.view(torch.int16).numpy().view(np.uint16))  # bf16 bits
                     if t.dtype == torch.bfloat16 else (lambda x: x.numpy()))
            assert_same(as_np(g), as_np(t), f"stage {stage} {dtypes} {name}")
            if t.dtype == torch.float32:  # torch's CUDA ops: close, not promised bitwise
                assert torch.allclose(g, r, rtol=2 ** -20, atol=1e-8), (stage, dtypes, name)
