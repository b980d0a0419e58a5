"""`python -m zerompi.prepare` over a Hugging Face `datasets` save_to_disk folder
(zerompi/data/readers.py): built here, no network. The token ids of the shards are
those of the tokenizer applied directly; a DatasetDict, an absent or a non-text column
and a missing `datasets` package are one line each; a folder saved again is redone."""
import shutil
import sys

import h5py
import numpy as np
import pytest

from tiny_corpus import documents, train_tokenizer
from zerompi.data import prepare as prep
from zerompi.data.readers import PrepareError


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    datasets = pytest.importorskip("datasets")
    d = tmp_path_factory.mktemp("hf")
    docs = documents(60, seed=2)
    datasets.DatasetDict({
        "train": datasets.Dataset.from_dict({"id": list(range(50)), "body": docs[:50]}),
        "test": datasets.Dataset.from_dict({"id": list(range(10)), "body": docs[50:]}),
    }).save_to_disk(str(d / "dd"))
    return {"dd": d / "dd", "docs": docs, "tok": str(train_tokenizer(d / "tokenizer.json"))}


def _main(args, capsys):
    from zerompi.prepare import main

    rc = main([str(a) for a in args] + ["--progress", "none"])
    return rc, capsys.readouterr().err


def _docs_of(out, split="train"):
    """Every document's ids, in shard order."""
    got = []
    for f in sorted((out / split).glob("*.h5")):
        with h5py.File(f) as h:
            ids, offs = h["tokens"][:], h["doc_offsets"][:]
            got += [ids[a:b].tolist() for a, b in zip(offs[:-1], offs[1:])]
    return got


def test_a_split_folder_gives_the_ids_of_the_tokenizer_itself(folder, tmp_path, capsys):
    from tokenizers import Tokenizer

    out = tmp_path / "o"
    rc, err = _main([folder["dd"] / "test", "--field", "body", "--tokenizer", folder["tok"], "--unit_mb", 0.0005,
                     "--workers", 2, "--out", out], capsys)
    assert rc == 0, err
    units = len(list((out / "train").glob("*.h5")))
    assert units > 1  # several row ranges, shared by the two workers
    tok = Tokenizer.from_file(folder["tok"])
    want = [e.ids + [0] for e in tok.encode_batch(folder["docs"][50:], add_special_tokens=False)]  # 0: <|endoftext|>
    assert _docs_of(out) == want


@pytest.mark.parametrize("case, needle", [
    ("dict", "a DatasetDict (train, test): name one split's folder ({dd}/train)"),
    ("absent", "no column 'text' (--field; columns: id, body)"),
    ("not text", "column 'id' (--field) holds int64, not text"),
])
def test_bad_datasets_input_is_one_line_exit_2(folder, tmp_path, capsys, case, needle):
    args = {"dict": [folder["dd"], "--field", "body"], "absent": [folder["dd"] / "train"],
            "not text": [folder["dd"] / "train", "--field", "id"]}[case]
    rc, err = _main(args + ["--out", tmp_path / "o"], capsys)
    assert rc == 2 and err.count("\n") == 1 and err.startswith("zerompi.prepare: error:"), err
    assert needle.format(dd=folder["dd"]) in err, err


def test_a_folder_saved_again_is_prepared_again(folder, tmp_path):
    """Same rows, other text: the shards of the first folder must not be taken as done."""
    import datasets

    src, docs = tmp_path / "ds", documents(30, seed=3)
    datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(src))
    assert prep.prepare([str(src)], str(tmp_path / "o"), progress=False)["done_before"] == 0
    shutil.rmtree(src)
    other = [d.upper() for d in docs]
    datasets.Dataset.from_dict({"text": other}).save_to_disk(str(src))
    r = prep.prepare([str(src)], str(tmp_path / "o"), progress=False)
    assert r["done_before"] == 0
    assert [bytes(np.array(d, np.uint8)).decode() for d in _docs_of(tmp_path / "o")] == other


def test_without_the_datasets_package_one_line_says_so(tmp_path, monkeypatch):
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "state.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` raises ImportError
    with pytest.raises(PrepareError, match=r"the datasets package is not installed \(pip install datasets\)"):
        prep.prepare([str(tmp_path / "ds")], str(tmp_path / "o"), progress=False)
