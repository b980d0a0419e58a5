"""What `python -m zerompi.prepare` reads: its inputs cut into units (pieces of bounded
size that one worker tokenizes into one shard), the documents of a unit, and tokenizers.

Inputs: text files, JSONL (one JSON object per line, the text in `field`), Parquet (the
`field` column) and a Hugging Face `datasets` save_to_disk folder (when `datasets`
imports). Units are byte ranges of text and JSONL files cut at line starts, row-group
ranges of Parquet files and row ranges of a datasets folder, each about `unit_bytes` of
input: a worker never holds more than one unit's documents and tokens, whatever the
size of the input. How the input is cut depends on the input and `unit_bytes` alone, so
the shards are the same whatever the number of workers.
"""
from __future__ import annotations

import hashlib
import json
import os
import pathlib
from dataclasses import dataclass

import numpy as np

TEXT = (".txt", ".md", ".text", ".rst")
JSONL = (".jsonl", ".json", ".ndjson")
PARQUET = (".parquet",)


class PrepareError(ValueError):
    """Bad input or settings: prepare prints the message alone and exits 2."""


@dataclass(frozen=True)
class Unit:
    index: int
    path: str
    kind: str     # text | jsonl | parquet | hf
    start: int    # bytes (text, jsonl), row groups (parquet) or rows (hf)
    stop: int

    def describe(self) -> str:
        what = {"text": "bytes", "jsonl": "bytes", "parquet": "row groups", "hf": "rows"}[self.kind]
        return f"{self.path} {what} {self.start}-{self.stop}"


def _is_hf_dir(p: pathlib.Path) -> bool:
    return (p / "dataset_info.json").is_file() or (p / "state.json").is_file()


def _refuse_dataset_dict(p: pathlib.Path) -> None:
    """A DatasetDict's save_to_disk folder holds one folder per split (and no text files):
    the user names the split (no datasets import needed to say so)."""
    try:
        splits = json.loads((p / "dataset_dict.json").read_text())["splits"]
    except (OSError, ValueError, KeyError, TypeError):
        splits = sorted(d.name for d in p.iterdir() if d.is_dir() and _is_hf_dir(d))
    raise PrepareError(f"input {p}: a DatasetDict ({', '.join(splits)}): name one split's folder "
                       f"({p / splits[0] if splits else p / 'SPLIT'})")


def input_stamp(path: str, kind: str) -> int | list:
    """What tells this input from an edited one of the same name for a resume: a file's
    size; a datasets folder's state.json (its fingerprint) and data file sizes, since a
    folder saved again with other text keeps its row count."""
    if kind != "hf":
        return os.path.getsize(path)
    p = pathlib.Path(path)
    state = (p / "state.json").read_text() if (p / "state.json").is_file() else ""
    return [state] + [[f.name, f.stat().st_size] for f in sorted(p.iterdir()) if f.is_file()]


def input_files(inputs: list[str]) -> list[tuple[str, str]]:
    """(path, kind) of every input in order; folders walked in sorted order."""
    out = []
    for item in inputs:
        p = pathlib.Path(item)
        if not p.exists():
            raise PrepareError(f"input {item}: no such file or folder")
        if p.is_dir() and (p / "dataset_dict.json").is_file():
            _refuse_dataset_dict(p)
        if p.is_dir() and _is_hf_dir(p):
            out.append((str(p), "hf"))
        elif p.is_dir():
            found = [f for f in sorted(p.rglob("*")) if f.is_file() and f.suffix.lower() in TEXT + JSONL + PARQUET]
            if not found:
                raise PrepareError(f"input {item}: a folder with no {', '.join(TEXT + JSONL + PARQUET)} files")
            out += [(str(f), _kind(f)) for f in found]
        else:
            out.append((str(p), _kind(p)))
    return out


def _kind(p: pathlib.Path) -> str:
    s = p.suffix.lower()
    if s in JSONL:
        return "jsonl"
    if s in PARQUET:
        return "parquet"
    if s in TEXT:
        return "text"
    raise PrepareError(f"input {p}: unknown kind of file ({s or 'no suffix'}); text ({', '.join(TEXT)}), "
                       f"JSONL ({', '.join(JSONL)}), Parquet (.parquet) or a datasets folder")


def _line_cuts(path: str, unit_bytes: int, blank: bool) -> list[int]:
    """Byte offsets that start a line (after a blank line when `blank`), about unit_bytes apart."""
    size = os.path.getsize(path)
    cuts = [0]
    with open(path, "rb") as f:
        while cuts[-1] + unit_bytes < size:
            f.seek(cuts[-1] + unit_bytes)
            f.readline()  # to the next line start
            while blank:
                line = f.readline()
                if not line or not line.strip():
                    break
            pos = f.tell()
            if pos >= size:
                break
            cuts.append(pos)
    return cuts + [size]


def plan(files: list[tuple[str, str]], unit_bytes: int, text_docs: str) -> list[Unit]:
    units: list[Unit] = []
    for path, kind in files:
        if kind in ("text", "jsonl"):
            cuts = _line_cuts(path, unit_bytes, kind == "text" and text_docs == "paragraph")
            spans = list(zip(cuts[:-1], cuts[1:])) or [(0, 0)]
        elif kind == "parquet":
            import pyarrow.parquet as pq

            md = pq.ParquetFile(path).metadata
            spans, first, size = [], 0, 0
            for g in range(md.num_row_groups):
                size += md.row_group(g).total_byte_size
                if size >= unit_bytes or g == md.num_row_groups - 1:
                    spans.append((first, g + 1))
                    first, size = g + 1, 0
        else:
            ds = _load_hf(path)
            rows = max(1, int(unit_bytes * len(ds) / max(1, ds.data.nbytes)))
            spans = [(a, min(a + rows, len(ds))) for a in range(0, len(ds), rows)]
        units += [Unit(len(units) + i, path, kind, a, b) for i, (a, b) in enumerate(spans)]
    return units


def _load_hf(path: str):
    try:
        import datasets
    except ImportError:
        raise PrepareError(f"input {path}: a Hugging Face datasets folder, but the datasets package is not "
                           "installed (pip install datasets)") from None
    ds = datasets.load_from_disk(path)
    if isinstance(ds, datasets.DatasetDict):  # input_files refuses these first; kept for a direct call
        raise PrepareError(f"input {path}: a DatasetDict ({', '.join(ds)}): name one split's folder")
    return ds


def _hf_text_column(unit: Unit, field: str):
    """The unit's dataset reduced to its `field` column, which must hold strings: another
    type would be read as empty documents."""
    ds = _load_hf(unit.path)
    if field not in ds.column_names:
        raise PrepareError(f"input {unit.path}: no column {field!r} (--field; columns: "
                           f"{', '.join(ds.column_names)})")
    kind = getattr(ds.features[field], "dtype", type(ds.features[field]).__name__)
    if kind not in ("string", "large_string"):
        raise PrepareError(f"input {unit.path}: column {field!r} (--field) holds {kind}, not text")
    return ds.select_columns([field])  # the slices below then read no other column


def documents(unit: Unit, field: str, text_docs: str, batch: int = 1024):
    """Yield lists of document strings (at most `batch` per list) of `unit`, in order."""
    if unit.kind == "text":
        with open(unit.path, "rb") as f:
            f.seek(unit.start)
            text = f.read(unit.stop - unit.start).decode("utf-8", errors="replace")
        if text_docs == "file":
            docs = [text] if text else []
        elif text_docs == "line":
            docs = [ln for ln in text.split("\n") if ln.strip()]
        else:
            docs = [d.strip("\n") for d in text.split("\n\n") if d.strip()]
        for i in range(0, len(docs), batch):
            yield docs[i:i + batch]
    elif unit.kind == "jsonl":
        out: list[str] = []
        with open(unit.path, "rb") as f:
            f.seek(unit.start)
            pos = unit.start
            while pos < unit.stop:
                line = f.readline()
                if not line:
                    break
                if line.strip():
                    out.append(_field(unit, pos, line, field))
                pos += len(line)
                if len(out) == batch:
                    yield out
                    out = []
        if out:
            yield out
    elif unit.kind == "parquet":
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(unit.path)
        if field not in pf.schema_arrow.names:
            raise PrepareError(f"input {unit.path}: no column {field!r} (--field; columns: "
                               f"{', '.join(pf.schema_arrow.names)})")
        for rb in pf.iter_batches(batch_size=batch, row_groups=range(unit.start, unit.stop), columns=[field]):
            yield [v if isinstance(v, str) else "" for v in rb.column(0).to_pylist()]
    else:
        ds = _hf_text_column(unit, field)
        for a in range(unit.start, unit.stop, batch):
            yield [v if isinstance(v, str) else "" for v in ds[a:min(a + batch, unit.stop)][field]]


def _field(unit: Unit, pos: int, line: bytes, field: str) -> str:
    try:
        obj = json.loads(line)
    except ValueError as e:
        raise PrepareError(f"input {unit.path}: the line at byte {pos} is not JSON ({e})") from None
    if not isinstance(obj, dict) or field not in obj:
        raise PrepareError(f"input {unit.path}: the line at byte {pos} has no {field!r} field (--field)")
    v = obj[field]
    if not isinstance(v, str):
        raise PrepareError(f"input {unit.path}: the line at byte {pos}: {field!r} is {type(v).__name__}, "
                           "not a string")
    return v


# ---------------------------------------------------------------- tokenizers

_EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>")


class Tokenizer:
    """bytes (ids = UTF-8 bytes, vocab 256), a tokenizer.json, or a Hugging Face
    tokenizer folder (its tokenizer.json through `tokenizers`, else `transformers`
    AutoTokenizer with local files only). Loaded in each worker."""

    def __init__(self, spec: str) -> None:
        self.spec = spec
        self._hf = self._fast = None
        if spec == "bytes":
            self.name, self.vocab_size, self.eos_id = "bytes", 256, None
            self.sha256 = hashlib.sha256(b"zerompi byte-level tokens").hexdigest()
            return
        p = pathlib.Path(spec)
        if not p.exists():
            raise PrepareError(f"--tokenizer {spec}: no such file or folder (a tokenizer.json, a Hugging Face "
                               "tokenizer folder, or bytes)")
        file = p / "tokenizer.json" if p.is_dir() else p
        self.name = p.resolve().parent.name if p.name == "tokenizer.json" else p.name
        h = hashlib.sha256()
        for f in ([file] if file.is_file() else sorted(x for x in p.iterdir() if x.is_file())):
            h.update(f.name.encode() + f.read_bytes())
        self.sha256 = h.hexdigest()
        try:
            if file.is_file():
                from tokenizers import Tokenizer as Fast

                self._fast = Fast.from_file(str(file))
                self.vocab_size = self._fast.get_vocab_size(with_added_tokens=True)
                ids = [self._fast.token_to_id(t) for t in _EOS_NAMES]
                self.eos_id = next((i for i in ids if i is not None), None)
            else:
                from transformers import AutoTokenizer

                self._hf = AutoTokenizer.from_pretrained(str(p), local_files_only=True)
                self.vocab_size, self.eos_id = len(self._hf), self._hf.eos_token_id
        except PrepareError:
            raise
        except Exception as e:  # tokenizers/transformers raise many kinds
            raise PrepareError(f"--tokenizer {spec}: cannot load it ({type(e).__name__}: {e})") from None

    def encode(self, docs: list[str]) -> list[np.ndarray]:
        if self._fast is not None:
            return [np.asarray(e.ids, np.int64) for e in self._fast.encode_batch(docs, add_special_tokens=False)]
        if self._hf is not None:
            return [np.asarray(i, np.int64) for i in self._hf(docs, add_special_tokens=False)["input_ids"]]
        return [np.frombuffer(d.encode("utf-8"), np.uint8).astype(np.int64) for d in docs]


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds ids 0 .. vocab_size-1."""
    for dt in (np.uint8, np.uint16, np.uint32):
        if vocab_size - 1 <= np.iinfo(dt).max:
            return np.dtype(dt)
    return np.dtype(np.uint64)
