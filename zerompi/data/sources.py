"""What the trainer's `data` and `data_val` keys name: one token file, a comma-separated
list, a glob, a folder of shards, or a `python -m zerompi.prepare` output folder; each file
opened and checked by check.py, the files joined end to end (Concat) in the order given
(a folder's and a glob's files sorted by name). docs/data.md.

A prepare output folder (it holds prepare.json) means its train/ shards, and its val/
shards become the validation set unless `data_val` names another."""
from __future__ import annotations

import glob
import json
import pathlib
from dataclasses import dataclass

import numpy as np

from .check import DataError, Source, sample_max, open_source
from .tokens import split_tokens

# token files a folder contributes (a Megatron .idx and sidecar .json travel with their .bin)
SHARD_SUFFIXES = (".h5", ".hdf5", ".bin", ".npy")
MANIFEST = "prepare.json"


class Concat:
    """Several 1-D token sources read as one: contiguous slices may cross files."""

    def __init__(self, parts: list) -> None:
        self.parts = parts
        self.ends = np.cumsum([len(p) for p in parts], dtype=np.int64)
        self.dtype = np.result_type(*[np.dtype(p.dtype) for p in parts])

    def __len__(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0

    def __getitem__(self, key: slice) -> np.ndarray:
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError("Concat supports contiguous slices only")
        a, b, _ = key.indices(len(self))
        out = []
        i = int(np.searchsorted(self.ends, a, side="right"))
        while a < b and i < len(self.parts):
            start = int(self.ends[i - 1]) if i else 0
            stop = min(b, int(self.ends[i]))
            out.append(np.asarray(self.parts[i][a - start: stop - start], dtype=self.dtype))
            a, i = stop, i + 1
        return np.concatenate(out) if out else np.empty(0, self.dtype)


def _files(item: str) -> list[str]:
    if any(c in item for c in "*?["):
        found = sorted(glob.glob(item))
        if not found:
            raise DataError(f"data {item}: the pattern matches no file")
        return found
    p = pathlib.Path(item)
    if p.is_dir():
        found = sorted(str(f) for f in p.iterdir() if f.suffix.lower() in SHARD_SUFFIXES and f.is_file())
        if not found:
            raise DataError(f"data {item}: a folder with no token files ({', '.join(SHARD_SUFFIXES)})")
        return found
    return [item]


def resolve(spec: str, val_spec: str = "") -> tuple[list[str], list[str] | None]:
    """(train files, validation files or None: split from the train tokens)."""
    items = [s.strip() for s in spec.split(",") if s.strip()]
    val_items = [s.strip() for s in val_spec.split(",") if s.strip()]
    if len(items) == 1 and (pathlib.Path(items[0]) / "train").is_dir():
        out = pathlib.Path(items[0])
        try:
            manifest = json.loads((out / MANIFEST).read_text())
        except (OSError, ValueError):
            raise DataError(f"data {spec}: a prepare output without its {MANIFEST} (unfinished?): rerun the "
                            "same python -m zerompi.prepare command, it resumes") from None
        items = [str(out / "train")]
        if not val_items and manifest.get("tokens", {}).get("val"):
            val_items = [str(out / "val")]
    train = [f for it in items for f in _files(it)]
    val = [f for it in val_items for f in _files(it)] if val_items else None
    return train, val


def open_many(files: list[str], dtype: str | None, docs: bool = True) -> Source:
    """The files as one Source (documents, if `docs`: only when every file knows its own)."""
    _open_files_limit(len(files), files[0])
    srcs = [open_source(f, dtype, docs) for f in files]
    _same_tokenizer(list(zip(files, srcs)))
    srcs = [s for s in srcs if len(s.tokens)] or srcs[:1]  # prepare writes empty val shards
    if len(srcs) == 1:
        return srcs[0]
    vocabs = [s.vocab for s in srcs if s.vocab is not None]
    docs = None
    if all(s.doc_starts is not None for s in srcs):
        offs = np.concatenate([[0], np.cumsum([len(s.tokens) for s in srcs])[:-1]])
        docs = np.concatenate([s.doc_starts + o for s, o in zip(srcs, offs)])
    kinds = sorted({s.what.split(" (")[0] for s in srcs})
    t = Concat([s.tokens for s in srcs])
    return Source(t, f"{len(srcs)} files ({', '.join(kinds)}; {len(t):,} tokens)", max(vocabs) if vocabs else None,
                  docs, srcs[0].tokenizer)


def _open_files_limit(n: int, first: str) -> None:
    """Each opened file holds a descriptor (memmap): raise the soft limit if it is too low."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = n + 256  # and what MPI, torch and the checkpoints open
    if soft == resource.RLIM_INFINITY or soft >= need:
        return
    new = need if hard == resource.RLIM_INFINITY else min(hard, need)
    resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
    if new < need:
        raise DataError(f"data {first} ...: {n:,} token files, but a process may open {hard:,} files (ulimit -Hn): "
                        "join them into fewer (a larger python -m zerompi.prepare --unit_mb)")


def _same_tokenizer(named: list[tuple[str, Source]]) -> None:
    """Files that record their tokenizer must record the same one: ids of two vocabularies
    read as one stream are valid ids and garbage."""
    known = [(f, s.tokenizer) for f, s in named if s.tokenizer]
    for f, h in known[1:]:
        if h != known[0][1]:
            raise DataError(f"data {f}: tokenized with another tokenizer (sha256 {h[:12]}) than {known[0][0]} "
                            f"({known[0][1][:12]}); train on shards of one tokenizer")


@dataclass
class Data:
    """The trainer's data, checked: train and validation tokens and their documents."""
    train: Source
    val: Source
    what: str


def _check_ids(name: str, src: Source, vocab_size: int) -> str:
    if src.vocab is not None and int(src.vocab) > vocab_size:
        raise DataError(f"data {name}: tokenized for vocab_size {src.vocab} (recorded with the tokens) but "
                        f"the model has {vocab_size}: set model.vocab_size = {src.vocab}")
    hi, lo, where = sample_max(src.tokens, len(src.tokens))
    if lo < 0:
        raise DataError(f"data {name}: negative token ids; token ids are 0 .. vocab_size-1")
    if hi >= vocab_size:
        raise DataError(f"data {name}: token id {hi} at position {where:,} is >= the model's vocab_size "
                        f"{vocab_size}: set model.vocab_size (at least {hi + 1}) or use data "
                        "tokenized for this model")
    return src.what


def _cut(src: Source, val_fraction: float) -> tuple[Source, Source]:
    train, val = split_tokens(src.tokens, val_fraction)
    cut = len(train)
    d = src.doc_starts
    tdocs = d[d < cut] if d is not None else None
    vdocs = np.concatenate([[0], d[d > cut] - cut]) if d is not None else None
    return Source(train, src.what, src.vocab, tdocs), Source(val, src.what, src.vocab, vdocs)


def check_data(spec: str, val_spec: str, dtype: str | None, vocab_size: int, block_size: int,
               val_fraction: float, need_val: bool, need_docs: bool) -> Data:
    """Open and check the training data (and validation data) a config names. Raises DataError."""
    train_files, val_files = resolve(spec, val_spec)
    src = open_many(train_files, dtype, need_docs)
    what = _check_ids(spec, src, vocab_size)
    if val_files is None:
        train, val = _cut(src, val_fraction)
        where = f"validation: the last {val_fraction:g} of the tokens (val_fraction)"
    else:
        train, val = src, open_many(val_files, dtype, need_docs)
        _same_tokenizer([(spec, train), (val_spec or val_files[0], val)])
        _check_ids(val_spec or ",".join(val_files), val, vocab_size)
        where = f"validation: {len(val_files)} file(s), {len(val.tokens):,} tokens"
    if need_docs and (train.doc_starts is None or (need_val and val.doc_starts is None)):
        raise DataError(f"doc_mask = true: data {spec} does not record its documents (prepare's shards and "
                        "Megatron .bin+.idx do; flat token files do not)")
    for name, part, needed in (("training", train, True), ("validation", val, need_val)):
        if needed and len(part.tokens) < block_size + 1:
            raise DataError(f"data {spec}: the {name} tokens ({len(part.tokens):,}) are fewer than "
                            f"block_size+1 = {block_size + 1}")
    sampled = min(len(src.tokens), 64 * (1 << 14))
    return Data(train, val, f"{what}; ids < {vocab_size} in a {sampled:,}-token sample, the rest checked as "
                            f"read; {where}")


def open_agreed_data(cfg, vocab_size: int, block_size: int, spec: str, comm) -> Data | None:
    """check_data on every rank, failures agreed (runtime.agree): all ranks go on or all
    stop; None after rank 0 printed the job's one error line. Collective over `comm`."""
    from .. import runtime
    from ..runtime.console import say

    data = error = None
    try:
        data = check_data(spec, cfg.data_val, cfg.data_dtype or None, vocab_size, block_size,
                          cfg.val_fraction, bool(cfg.eval_interval), cfg.doc_mask)
    except DataError as e:
        error = e
    errors = runtime.agree(comm, error)
    if errors:
        say(f"error: {errors[0][2]}", rank=comm.rank, prog="zerompi.train")
        return None
    say(f"data {spec}: {data.what}", rank=comm.rank, prog="zerompi.train", err=False)
    return data
