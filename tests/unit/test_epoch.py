"""The epoch order (zerompi/data/epoch.py through TokenSampler order="epoch"): every window
once per epoch whatever the world size and micro-steps, resumable at a position; document
ids and the GPT's document mask; the trainer's data specs (zerompi/data/sources.py)."""
import numpy as np
import pytest
import torch

from zerompi.data import TokenSampler
from zerompi.data.check import DataError
from zerompi.data.epoch import doc_ids, epoch_windows
from zerompi.data.sources import Concat, check_data, resolve

T = 4


def _drawn(sampler, steps, world, B, G):
    """Windows of every row, ranks 0..N-1 of micro-step 0, then of micro-step 1, ...: the
    order a single rank reads them."""
    out = []
    for step in steps:
        for m in range(G):
            for r in range(world):
                x, _ = sampler.batch(step, m, r, world, B, G)
                a, b = sampler.row_range(m, r, world, B, G)
                offs = sampler.offsets(step, B)[a:b]
                assert torch.equal(x[:, 0], torch.from_numpy(np.asarray(sampler.tokens)[offs]).long())
                out += (offs // T).tolist()
    return out


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("B, G", [(5, 1), (6, 2)])
def test_every_window_once_per_epoch_at_any_world_size(world, B, G):
    tokens = np.arange(37 * T + 1, dtype=np.int64)  # W = 37 windows, prime: epochs end mid-step
    s = TokenSampler(tokens, T, seed=3, order="epoch")
    W = s.num_windows()
    assert W == 37
    seen = _drawn(s, range(3 * W // B + 1), world, B, G)
    for e in range(3):
        assert sorted(seen[e * W:(e + 1) * W]) == list(range(W)), (world, e)
    assert seen[:W] != seen[W:2 * W]  # each epoch has its own order
    assert seen == _drawn(TokenSampler(tokens, T, seed=3, order="epoch"), range(3 * W // B + 1), 1, B, 1)


def test_order_is_a_pure_function_of_seed_epoch_position():
    a = epoch_windows(7, 11, np.arange(40))
    assert np.array_equal(a, epoch_windows(7, 11, np.arange(40), cache={}))
    assert np.array_equal(a[25:31], epoch_windows(7, 11, np.arange(25, 31)))
    assert not np.array_equal(a, epoch_windows(8, 11, np.arange(40)))


def test_resume_continues_at_the_saved_position():
    tokens = np.arange(50 * T + 1)
    full = TokenSampler(tokens, T, seed=1, order="epoch")
    later = TokenSampler(tokens, T, seed=1, order="epoch")
    later.resume_at(7, full.position(7, 8))
    for step in range(7, 20):
        assert np.array_equal(full.offsets(step, 8), later.offsets(step, 8))
    # another global batch after the resume: the walk goes on from the position, nothing repeated
    other = TokenSampler(tokens, T, seed=1, order="epoch")
    other.resume_at(7, full.position(7, 8))
    seen = [w for s in range(7) for w in full.offsets(s, 8) // T] + \
           [w for s in range(7, 8) for w in other.offsets(s, 6) // T]
    assert len(seen) == 62 and sorted(seen[:50]) == list(range(50)) and len(set(seen[50:])) == 12


def test_doc_ids_and_the_gpt_mask_keep_documents_apart():
    from zerompi.models.gpt import GPT, PRESETS

    starts = np.array([0, 5, 9])
    assert doc_ids(starts, np.array([3]), 8).tolist() == [[0, 0, 1, 1, 1, 1, 2, 2]]
    torch.manual_seed(0)
    model = GPT(PRESETS["tiny"]).eval()
    x = torch.randint(0, 256, (1, 12))
    d = torch.from_numpy(doc_ids(starts, np.array([0]), 12))
    y = x.clone()
    y[0, :5] = (y[0, :5] + 1) % 256  # another first document
    with torch.no_grad():
        masked = model(x, doc_ids=d), model(y, doc_ids=d)
        plain = model(x), model(y)
    assert torch.equal(masked[0][0, 5:], masked[1][0, 5:])  # later documents do not see it
    assert not torch.allclose(plain[0][0, 5:], plain[1][0, 5:])
    assert torch.equal(model(x, doc_ids=torch.zeros_like(d)), model(x))  # one document: plain causal


def test_concat_reads_across_files_and_specs_resolve(tmp_path):
    parts = [np.arange(0, 5), np.arange(5, 7), np.arange(7, 20)]
    c = Concat(parts)
    assert len(c) == 20 and c[3:15].tolist() == list(range(3, 15)) and c[6:6].tolist() == []
    for i, p in enumerate(parts):
        np.save(tmp_path / f"p{i}.npy", p.astype(np.int32))
    (tmp_path / "notes.txt").write_text("x")  # not a token file: a folder listing skips it
    train, val = resolve(str(tmp_path))
    assert [f.rsplit("/", 1)[1] for f in train] == ["p0.npy", "p1.npy", "p2.npy"] and val is None
    d = check_data(f"{tmp_path}/p2.npy,{tmp_path}/p0.npy", str(tmp_path / "p1.npy"), None, 256, 1, 0.0, True, False)
    assert np.asarray(d.train.tokens[0:18]).tolist() == list(range(7, 20)) + list(range(5))
    assert np.asarray(d.val.tokens[0:2]).tolist() == [5, 6]
    with pytest.raises(DataError, match="doc_mask = true: data .* does not record its documents"):
        check_data(str(tmp_path), "", None, 256, 1, 0.1, False, True)


def test_many_files_raise_the_open_files_limit(tmp_path):
    import resource

    from zerompi.data.sources import open_many

    for i in range(120):
        np.save(tmp_path / f"s{i:03d}.npy", np.full(10, i, np.int32))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 400:
        pytest.skip(f"hard open-files limit {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (300, hard))  # below the 120 + 256 it needs
    try:
        src = open_many(sorted(str(p) for p in tmp_path.iterdir()), None)
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] >= 376
        assert np.asarray(src.tokens[1195:1200]).tolist() == [119] * 5
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
