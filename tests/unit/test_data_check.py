"""Data validation at start (zerompi/data/check.py): formats detected from their bytes,
sizes and dtypes checked, ids checked against the vocabulary on a sample and lazily per
batch (the trainer's messages for bad data: tests/system/test_train_data.py)."""
import json

import numpy as np
import pytest
import torch

from bad_tokens import bad_outside_sample
from zerompi.data import write_tokens
from zerompi.data import check as dc


def test_formats_are_detected_and_read(tmp_path):
    ids = np.arange(1000) % 256
    write_tokens(tmp_path / "z.bin", ids, vocab_size=256)
    np.save(tmp_path / "a.npy", ids.astype(np.int32))
    (tmp_path / "raw.bin").write_bytes(ids.astype(np.uint16).tobytes())
    header = np.zeros(256, np.int32)
    header[:3] = [20240520, 1, len(ids)]
    (tmp_path / "llmc.bin").write_bytes(header.tobytes() + ids.astype(np.uint16).tobytes())
    import h5py

    with h5py.File(tmp_path / "t.h5", "w") as f:
        f["tokens"] = ids.astype(np.int64)
    for name, kind in [("z.bin", "zerompi token file"), ("a.npy", ".npy"), ("raw.bin", "headerless"),
                       ("llmc.bin", "llm.c"), ("t.h5", "HDF5"), ("t.h5:/tokens", "HDF5")]:
        tokens, what, _ = dc.open_checked(str(tmp_path / name))
        assert kind in what, (name, what)
        assert np.array_equal(np.asarray(tokens[0:1000]), ids), name


@pytest.mark.parametrize("case, message", [
    ("text", "this is a text file, not tokens"),
    ("missing", "no such file"),
    ("empty", "the file is empty"),
    ("truncated", "truncated or the wrong sidecar"),
    ("bad_dtype", "token files are uint16 or uint32"),
    ("odd_size", "not a multiple of 2 bytes"),
    ("fake_h5", "not an HDF5 file"),
    ("llmc_short", "llm.c header says"),
    ("npy_2d", "need a 1-D integer array"),
])
def test_bad_sources_name_the_problem(tmp_path, case, message):
    p = tmp_path / "d.bin"
    if case == "text":
        p.write_text("def f():\n    return 'hello'\n" * 100)
    elif case == "empty":
        p.write_bytes(b"")
    elif case == "truncated":
        write_tokens(p, np.arange(100))
        p.write_bytes(p.read_bytes()[:-2])
    elif case == "bad_dtype":
        write_tokens(p, np.arange(100))
        (tmp_path / "d.json").write_text(json.dumps({"format": "zerompi-tokens", "dtype": "float32"}))
    elif case == "odd_size":
        p.write_bytes(b"\0\1\0")
    elif case == "fake_h5":
        p = tmp_path / "d.h5"
        p.write_bytes(b"\0" * 64)
    elif case == "llmc_short":
        header = np.zeros(256, np.int32)
        header[:3] = [20240520, 1, 500]
        p.write_bytes(header.tobytes() + b"\0\0" * 10)
    elif case == "npy_2d":
        p = tmp_path / "d.npy"
        np.save(p, np.zeros((4, 4), np.int32))
    with pytest.raises(dc.DataError, match=message):
        dc.check_source(str(p), 256, 8, 0.1, True)


def test_ids_beyond_the_vocabulary_are_found_on_the_sample(tmp_path):
    ids = np.random.default_rng(0).integers(0, 256, 50_000)
    ids[31_337] = 300
    write_tokens(tmp_path / "d.bin", ids)
    with pytest.raises(dc.DataError, match=r"token id 300 at position 31,337 .* vocab_size 256"):
        dc.check_source(str(tmp_path / "d.bin"), 256, 8, 0.1, True)
    # The sidecar's own vocab_size is checked against the model before any id is read.
    write_tokens(tmp_path / "e.bin", ids % 256, vocab_size=50257)
    with pytest.raises(dc.DataError, match="tokenized for vocab_size 50257"):
        dc.check_source(str(tmp_path / "e.bin"), 256, 8, 0.1, True)


def test_too_short_for_a_window(tmp_path):
    write_tokens(tmp_path / "d.bin", np.arange(100) % 256)
    with pytest.raises(dc.DataError, match="validation.*shorter than block_size"):
        dc.check_source(str(tmp_path / "d.bin"), 256, 64, 0.05, True)
    dc.check_source(str(tmp_path / "d.bin"), 256, 64, 0.05, False)  # no eval: fine


def test_the_rest_is_checked_lazily_per_batch(tmp_path):
    n = dc._SAMPLE_CHUNKS * dc._CHUNK * 2
    write_tokens(tmp_path / "d.bin", bad_outside_sample(n))
    tokens, _ = dc.check_source(str(tmp_path / "d.bin"), 256, 16, 0.0, False)  # the sample passes
    s = dc.CheckedSampler(tokens, 16, seed=0, vocab_size=1000)
    s.batch(0, 0, 0, 1, 4)  # 999 < 1000: fine
    s = dc.CheckedSampler(tokens, 16, seed=0, vocab_size=256, spec="d.bin")
    with pytest.raises(dc.DataError, match="token id 999 .* found while training"):
        for step in range(20):
            s.batch(step, 0, 0, 1, 4)


def test_checked_sampler_equals_plain_sampler(tmp_path):
    from zerompi.data import TokenSampler

    ids = np.random.default_rng(1).integers(0, 256, 5000)
    write_tokens(tmp_path / "d.bin", ids)
    tokens, _ = dc.check_source(str(tmp_path / "d.bin"), 256, 16, 0.1, True)
    a = dc.CheckedSampler(tokens, 16, seed=3, vocab_size=256).batch(5, 1, 1, 2, 8, 2)
    b = TokenSampler(tokens, 16, seed=3).batch(5, 1, 1, 2, 8, 2)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
