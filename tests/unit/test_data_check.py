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
from zerompi.data.sources import check_data


def test_formats_are_detected_and_read(tmp_path):
    ids = np.arange(1000) % 256
    write_tokens(tmp_path / "z.bin", ids, vocab_size=256)
    np.save(tmp_path / "a.npy", ids.astype(np.int32))
    (tmp_path / "raw.bin").write_bytes(ids.astype(np.uint16).tobytes())
    header = np.zeros(256, np.int32)
    header[:3] = [20240520, 1, len(ids)]
    (tmp_path / "llmc.bin").write_bytes(header.tobytes() + ids.astype(np.uint16).tobytes())
    header[:3] = [20240801, 7, len(ids)]  # llm.c's Llama 3 shards: uint32 ids
    (tmp_path / "llmc3.bin").write_bytes(header.tobytes() + ids.astype(np.uint32).tobytes())
    import h5py

    with h5py.File(tmp_path / "t.h5", "w") as f:
        f["tokens"] = ids.astype(np.int64)
    for name, kind in [("z.bin", "zerompi token file"), ("a.npy", ".npy"), ("raw.bin", "headerless"),
                       ("llmc.bin", "llm.c token file (uint16"), ("llmc3.bin", "llm.c token file (uint32"),
                       ("t.h5", "HDF5"), ("t.h5:/tokens", "HDF5")]:
        tokens, what, _ = dc.open_checked(str(tmp_path / name), "uint16" if name == "raw.bin" else None)
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
    ("headerless", "a headerless token file .* name its dtype with data_dtype = "),
    ("uint32_as_uint16", "every other id in the first MB is 0, the pattern of uint32 tokens"),
    ("megatron_short", r"d.idx says 12 int32 tokens \(48 bytes\) but the file has 40 bytes"),
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
    elif case == "headerless":  # ids < 256 as uint32: no NUL-free text, no sidecar, no header
        p.write_bytes(np.arange(1, 5000, dtype=np.uint32).tobytes())
    elif case == "uint32_as_uint16":
        p.write_bytes((np.arange(1, 5000, dtype=np.uint32) % 50_000).tobytes())
    elif case == "megatron_short":
        _megatron(p, [np.arange(5), np.arange(7)], np.int32)
        p.write_bytes(p.read_bytes()[:-8])
    dtype = "uint16" if case in ("odd_size", "uint32_as_uint16") else None
    with pytest.raises(dc.DataError, match=message):
        check_data(str(p), "", dtype, 256 if case != "uint32_as_uint16" else 65536, 8, 0.1, True, False)


def _megatron(path, docs, dtype):
    """Megatron-LM's MMIDIDX layout (indexed_dataset.py): one sequence per document."""
    sizes = np.array([len(d) for d in docs], np.int32)
    pointers = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64) * np.dtype(dtype).itemsize
    code = {np.int32: 4, np.uint16: 8}[dtype]
    head = b"MMIDIDX\x00\x00" + np.array([1], "<u8").tobytes() + bytes([code]) \
        + np.array([len(docs), len(docs) + 1], "<u8").tobytes()
    path.with_suffix(".idx").write_bytes(head + sizes.tobytes() + pointers.tobytes()
                                         + np.arange(len(docs) + 1, dtype=np.int64).tobytes())
    path.write_bytes(np.concatenate(docs).astype(dtype).tobytes())


def test_megatron_documents_and_named_dtype_are_read(tmp_path):
    _megatron(tmp_path / "m.bin", [np.arange(5), np.arange(7) + 100, np.arange(3)], np.uint16)
    src = dc.open_source(str(tmp_path / "m.bin"))
    assert "Megatron" in src.what and src.doc_starts.tolist() == [0, 5, 12]
    assert np.asarray(src.tokens[5:12]).tolist() == list(range(100, 107))
    raw = np.arange(1, 3000, dtype=np.uint32)
    (tmp_path / "r.bin").write_bytes(raw.tobytes())
    assert np.array_equal(dc.open_source(str(tmp_path / "r.bin"), "uint32").tokens, raw)


def test_ids_beyond_the_vocabulary_are_found_on_the_sample(tmp_path):
    ids = np.random.default_rng(0).integers(0, 256, 50_000)
    ids[31_337] = 300
    write_tokens(tmp_path / "d.bin", ids)
    with pytest.raises(dc.DataError, match=r"token id 300 at position 31,337 .* vocab_size 256"):
        check_data(str(tmp_path / "d.bin"), "", None, 256, 8, 0.1, True, False)
    # The sidecar's own vocab_size is checked against the model before any id is read.
    write_tokens(tmp_path / "e.bin", ids % 256, vocab_size=50257)
    with pytest.raises(dc.DataError, match="tokenized for vocab_size 50257"):
        check_data(str(tmp_path / "e.bin"), "", None, 256, 8, 0.1, True, False)


def test_too_short_for_a_window(tmp_path):
    write_tokens(tmp_path / "d.bin", np.arange(100) % 256)
    with pytest.raises(dc.DataError, match=r"the validation tokens \(\d+\) are fewer than block_size\+1"):
        check_data(str(tmp_path / "d.bin"), "", None, 256, 64, 0.05, True, False)
    check_data(str(tmp_path / "d.bin"), "", None, 256, 64, 0.05, False, False)  # no eval: fine


def test_the_rest_is_checked_lazily_per_batch(tmp_path):
    n = dc._SAMPLE_CHUNKS * dc._CHUNK * 2
    write_tokens(tmp_path / "d.bin", bad_outside_sample(n))
    tokens = check_data(str(tmp_path / "d.bin"), "", None, 256, 16, 0.0, False, False).train.tokens  # sample passes
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
    tokens = check_data(str(tmp_path / "d.bin"), "", None, 256, 16, 0.0, False, False).train.tokens
    a = dc.CheckedSampler(tokens, 16, seed=3, vocab_size=256).batch(5, 1, 1, 2, 8, 2)
    b = TokenSampler(tokens, 16, seed=3).batch(5, 1, 1, 2, 8, 2)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
