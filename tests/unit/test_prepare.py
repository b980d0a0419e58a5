"""`python -m zerompi.prepare` (zerompi/data/prepare.py, readers.py): JSONL, Parquet and text
to HDF5 shards that hold every document once, the same bytes with 1 and 2 workers,
resumable after a failure, bad input as one line (bounded memory, 2 MPI ranks:
tests/system/test_prepare_train.py)."""
import pathlib

import h5py
import numpy as np
import pytest

from tiny_corpus import documents, train_tokenizer, write_jsonl, write_parquet
from zerompi.data import prepare as prep


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    d = tmp_path_factory.mktemp("in")
    docs = documents(300, seed=1)
    return {"docs": docs, "jsonl": str(write_jsonl(d / "a.jsonl", docs[:150])),
            "parquet": str(write_parquet(d / "b.parquet", docs[150:], row_group_size=40)),
            "tok": str(train_tokenizer(d / "tokenizer.json"))}


def _files(out):
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(pathlib.Path(out).rglob("*")) if p.is_file()}


def _run(inputs, out, **kw):
    args = dict(tokenizer=inputs["tok"], val_fraction=0.2, unit_mb=0.004, progress=False)
    return prep.prepare([inputs["jsonl"], inputs["parquet"]], str(out), **{**args, **kw})


def test_shards_hold_every_document_once_and_match_across_workers(inputs, tmp_path):
    from tokenizers import Tokenizer

    one = _run(inputs, tmp_path / "w1", workers=1)
    _run(inputs, tmp_path / "w2", workers=2)
    assert one["units"] > 4  # several shards from each file, so the workers really share them
    assert _files(tmp_path / "w1") == _files(tmp_path / "w2")  # prepare.json included
    m = one["manifest"]
    assert m["vocab_size"] == 300 and m["dtype"] == "uint16" and m["eos_id"] == 0
    tok, got = Tokenizer.from_file(inputs["tok"]), []
    for split in ("train", "val"):
        for f in sorted((tmp_path / "w1" / split).glob("*.h5")):
            with h5py.File(f) as h:
                ids, offs = h["tokens"][:], h["doc_offsets"][:]
                assert ids.dtype == np.uint16 and h.attrs["tokenizer"] == pathlib.Path(inputs["tok"]).parent.name
                assert h.attrs["vocab_size"] == 300 and h.attrs["n_docs"] == len(offs) - 1
                for a, b in zip(offs[:-1], offs[1:]):
                    assert ids[b - 1] == 0  # <|endoftext|> closes each document
                    got.append(tok.decode(ids[a:b - 1].tolist()))
    assert sorted(got) == sorted(inputs["docs"])
    assert 0.1 < m["docs"]["val"] / 300 < 0.3


def test_prepare_resumes_after_a_failure(inputs, tmp_path, monkeypatch):
    clean = _run(inputs, tmp_path / "clean", workers=1)
    real, calls = prep._tokenize, []

    def dies_at_the_fourth(job):
        calls.append(job[0].index)
        if len(calls) == 4:
            raise KeyboardInterrupt  # as a kill: the unit's shards are never renamed into place
        return real(job)

    monkeypatch.setattr(prep, "_tokenize", dies_at_the_fourth)
    with pytest.raises(KeyboardInterrupt):
        _run(inputs, tmp_path / "out", workers=1)
    assert not (tmp_path / "out" / "prepare.json").exists()
    (tmp_path / "out" / "train" / "00009.h5.tmp").write_bytes(b"half")  # a write cut short
    monkeypatch.setattr(prep, "_tokenize", real)
    again = _run(inputs, tmp_path / "out", workers=2)
    assert again["done_before"] == 3 and again["units"] == clean["units"]
    assert _files(tmp_path / "out") == _files(tmp_path / "clean")
    assert _run(inputs, tmp_path / "out", workers=1)["done_before"] == clean["units"]  # all done: nothing redone


def test_text_and_byte_level(tmp_path):
    (tmp_path / "a.txt").write_text("first paragraph\nstill first\n\nsecond one\n")
    r = prep.prepare([str(tmp_path / "a.txt")], str(tmp_path / "o"), "bytes", text_docs="paragraph", progress=False)
    assert r["manifest"]["dtype"] == "uint8" and r["manifest"]["docs"]["train"] == 2
    with h5py.File(tmp_path / "o" / "train" / "00000.h5") as h:
        assert bytes(h["tokens"][:]) == b"first paragraph\nstill firstsecond one"
        assert h["doc_offsets"][:].tolist() == [0, 27, 37]


@pytest.mark.parametrize("case, needle", [
    ("field", "has no 'body' field (--field)"),
    ("tokenizer", "--tokenizer nope.json: no such file"),
    ("kind", "unknown kind of file (.csv)"),
])
def test_bad_input_is_one_line_exit_2(inputs, tmp_path, capsys, case, needle):
    from zerompi.prepare import main

    args = {"field": [inputs["jsonl"], "--field", "body"], "tokenizer": [inputs["jsonl"], "--tokenizer", "nope.json"],
            "kind": [str(tmp_path / "x.csv")]}[case]
    if case == "kind":
        (tmp_path / "x.csv").write_text("a,b\n")
    assert main(args + ["--out", str(tmp_path / "o"), "--progress", "none"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err and err.startswith("zerompi.prepare: error:"), err


def test_the_trainer_reads_a_prepare_folder_and_refuses_an_unfinished_one_or_mixed_tokenizers(inputs, tmp_path):
    from zerompi.data.check import DataError
    from zerompi.data.sources import check_data, resolve

    (tmp_path / "a.txt").write_text("some words\n\nmore words here\n" * 50)
    prep.prepare([str(tmp_path / "a.txt")], str(tmp_path / "o"), text_docs="paragraph", val_fraction=0.3, seed=1,
                 progress=False)
    train, val = resolve(str(tmp_path / "o"))
    assert [pathlib.Path(f).parent.name for f in train + val] == ["train", "val"]
    d = check_data(str(tmp_path / "o"), "", None, 256, 8, 0.05, True, True)
    assert d.train.doc_starts is not None and len(d.val.tokens) > 0
    prep.prepare([str(tmp_path / "a.txt")], str(tmp_path / "x"), inputs["tok"], progress=False)
    with pytest.raises(DataError, match="tokenized with another tokenizer"):
        check_data(f"{tmp_path}/o/train,{tmp_path}/x/train", "", None, 300, 8, 0.05, False, False)
    with pytest.raises(DataError, match="tokenized with another tokenizer"):
        check_data(str(tmp_path / "o"), str(tmp_path / "x" / "train"), None, 300, 8, 0.05, False, False)
    (tmp_path / "o" / "prepare.json").unlink()
    with pytest.raises(DataError, match="a prepare output without its prepare.json"):
        resolve(str(tmp_path / "o"))


def test_a_tokenizer_folder_without_tokenizer_json_goes_through_transformers(inputs, tmp_path):
    """vocab.json + merges.txt + tokenizer_config.json (no tokenizer.json): AutoTokenizer,
    local files only; the same ids as the same BPE read from its tokenizer.json."""
    import json

    from tokenizers import Tokenizer

    folder = tmp_path / "tok"
    folder.mkdir()
    Tokenizer.from_file(inputs["tok"]).model.save(str(folder))  # vocab.json, merges.txt
    eot = "<|endoftext|>"
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "GPT2Tokenizer", "add_prefix_space": False, "eos_token": eot, "bos_token": eot,
        "unk_token": eot}))
    kw = dict(workers=1, unit_mb=1, progress=False)
    prep.prepare([inputs["jsonl"]], str(tmp_path / "a"), str(folder), **kw)
    prep.prepare([inputs["jsonl"]], str(tmp_path / "b"), inputs["tok"], **kw)
    with h5py.File(tmp_path / "a" / "train" / "00000.h5") as a, h5py.File(tmp_path / "b" / "train" / "00000.h5") as b:
        assert a.attrs["tokenizer"] == "tok" and a.attrs["vocab_size"] == 300 and a.attrs["eos_id"] == 0
        assert np.array_equal(a["tokens"][:], b["tokens"][:]) and np.array_equal(a["doc_offsets"][:], b["doc_offsets"][:])
