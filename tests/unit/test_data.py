import hashlib
import json
import multiprocessing as mp

import h5py
import numpy as np
import pytest
import torch

from zerompi.data import (
    H5Tokens, TokenRange, TokenSampler, default_corpus, open_tokens, shard_range,
    split_tokens, write_tokens,
)

SMALL = 200_000  # bytes: keeps the corpus build well under a second


def _build(cache_dir: str) -> str:
    return str(default_corpus(cache_dir, max_bytes=SMALL))


def test_default_corpus_builds_and_caches(tmp_path):
    p = default_corpus(tmp_path, max_bytes=SMALL)
    meta = json.loads(p.with_suffix(".json").read_text())
    toks = open_tokens(p)
    assert toks.dtype == np.uint16 and len(toks) == SMALL == meta["byte_count"]
    assert int(toks.max()) < 256 and meta["file_count"] > 1
    raw = np.asarray(toks).astype(np.uint8).tobytes()
    assert hashlib.sha256(raw).hexdigest() == meta["sha256"]
    assert b"import" in raw
    st = p.stat()
    assert default_corpus(tmp_path, max_bytes=SMALL) == p
    st2 = p.stat()
    assert (st.st_ino, st.st_mtime_ns) == (st2.st_ino, st2.st_mtime_ns)  # not rebuilt
    assert len(open_tokens("default", cache_dir=tmp_path, max_bytes=SMALL)) == SMALL


def test_default_corpus_env_var(tmp_path, monkeypatch):
    monkeypatch.setenv("ZEROMPI_CACHE", str(tmp_path / "env"))
    assert default_corpus(max_bytes=1000).parent == tmp_path / "env"


def test_concurrent_builders(tmp_path):
    ctx = mp.get_context("spawn")
    with ctx.Pool(3) as pool:
        paths = pool.map(_build, [str(tmp_path)] * 3)
    assert len(set(paths)) == 1
    assert not list(tmp_path.glob("*.tmp"))
    data = open(paths[0], "rb").read()
    assert len(data) == 2 * SMALL
    ref = tmp_path / "ref"
    assert open(_build(str(ref)), "rb").read() == data


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_bin_roundtrip(tmp_path, dtype):
    vals = np.arange(0, 70_000 if dtype == "uint32" else 60_000, 7)
    p = write_tokens(tmp_path / "t.bin", vals, dtype=dtype)
    t = open_tokens(p)
    assert t.dtype == np.dtype(dtype) and len(t) == len(vals)
    np.testing.assert_array_equal(t[5:20], vals[5:20])
    # explicit dtype overrides (and works without the sidecar)
    p.with_suffix(".json").unlink()
    assert open_tokens(p, dtype=dtype)[3] == vals[3]
    with pytest.raises(ValueError):
        write_tokens(tmp_path / "bad.bin", [70_000], dtype="uint16")


def test_hdf5_roundtrip(tmp_path):
    vals = np.arange(1000, dtype=np.int32) * 3
    f = tmp_path / "tok.h5"
    with h5py.File(f, "w") as h:
        h["train"] = vals
        h.create_group("g")["val"] = vals[:10]
    t = open_tokens(f"{f}:/train")
    assert isinstance(t, H5Tokens) and len(t) == 1000
    np.testing.assert_array_equal(t[10:20], vals[10:20])
    assert len(open_tokens(f"{f}:/g/val")) == 10
    with pytest.raises(ValueError):
        open_tokens(str(f))  # two datasets: name required
    tr, va = split_tokens(t, 0.1)
    assert isinstance(tr, TokenRange) and (len(tr), len(va)) == (900, 100)
    np.testing.assert_array_equal(va[0:5], vals[900:905])
    s = TokenSampler(tr, 16, seed=1)
    x, y = s.batch(0, 0, 0, 1, 4)
    assert x.shape == (4, 16) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1]) and int(x.max()) < 900 * 3
    t.close()


def test_shard_range():
    assert [shard_range(10, r, 3) for r in range(3)] == [(0, 4), (4, 7), (7, 10)]
    assert [shard_range(2, r, 4) for r in range(4)] == [(0, 1), (1, 2), (2, 2), (2, 2)]


@pytest.fixture
def sampler():
    toks = np.arange(5000, dtype=np.uint16)  # token == position: easy to check
    return TokenSampler(toks, block_size=8, seed=123)


@pytest.mark.parametrize("global_batch,grad_accum", [(12, 1), (10, 3), (7, 2), (3, 2)])
def test_union_over_ranks_independent_of_world(sampler, global_batch, grad_accum):
    ref_x, ref_y = sampler.global_batch(5, global_batch)
    assert torch.equal(ref_x[:, 1:], ref_y[:, :-1])
    assert torch.equal(ref_x[:, 0] + 1, ref_y[:, 0])  # y is x shifted by one token
    for world in (1, 2, 3, 4):
        xs, ys = [], []
        for m in range(grad_accum):
            for r in range(world):
                x, y = sampler.batch(5, m, r, world, global_batch, grad_accum)
                assert x.shape == (sampler.rows(m, r, world, global_batch, grad_accum), 8)
                xs.append(x)
                ys.append(y)
        assert torch.equal(torch.cat(xs), ref_x) and torch.equal(torch.cat(ys), ref_y)


def test_steps_and_seeds(sampler):
    a = sampler.global_batch(0, 8)[0]
    assert torch.equal(a, sampler.global_batch(0, 8)[0])
    assert torch.equal(a, TokenSampler(sampler.tokens, 8, seed=123).global_batch(0, 8)[0])
    assert not torch.equal(a, sampler.global_batch(1, 8)[0])
    assert not torch.equal(a, TokenSampler(sampler.tokens, 8, seed=124).global_batch(0, 8)[0])


def test_train_val_disjoint():
    toks = np.arange(4000, dtype=np.uint32)
    tr, va = split_tokens(toks, 0.05)
    assert len(va) == 200 and len(tr) + len(va) == 4000
    train = TokenSampler(tr, 16, seed=0)
    val = TokenSampler(va, 16, seed=0)
    seen = set()
    for s in range(50):
        x, y = train.global_batch(s, 16)
        seen |= set(x.flatten().tolist()) | set(y.flatten().tolist())
    assert max(seen) < 3800
    assert val.num_windows() == (200 - 1) // 16
    vals = set()
    for i in range(val.num_eval_batches(4)):
        xs = [val.eval_batch(i, r, 2, 4)[0] for r in range(2)]
        vals |= set(torch.cat(xs).flatten().tolist())
    assert min(vals) >= 3800 and not vals & seen
    assert len(vals) == val.num_windows() * 16  # every eval window covered
    assert torch.equal(val.eval_batch(1, 0, 1, 4)[0], val.eval_batch(1, 0, 1, 4)[0])


def test_too_short():
    with pytest.raises(ValueError):
        TokenSampler(np.arange(8, dtype=np.uint16), block_size=8)
