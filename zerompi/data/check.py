"""Check a training data source before the first step, and every batch during training.

A bad --data used to surface late: a text file trained as uint16 "tokens" until an
IndexError deep in the embedding, once per rank. Here the source's format is detected
from its bytes (not trusted from its name), its size and dtype are checked against that
format, and a sample of token ids is checked against the model's vocabulary; the whole
file is then checked lazily, batch by batch, as training reads it (`CheckedSampler`),
so no start-up pass over a multi-GB file is needed.

Formats (detected in this order):
  * HDF5 (magic ``\\x89HDF``): ``file.h5`` or ``file.h5:/dataset``, a 1-D integer dataset;
  * ``.npy`` (magic ``\\x93NUMPY``): a 1-D integer array, memory-mapped;
  * llm.c token shards (int32 header: magic 20240520, version 1, token count; uint16
    tokens from byte 1024);
  * zerompi ``.bin`` (uint16/uint32, dtype from the ``.json`` sidecar that
    zerompi.data.write_tokens writes; size must match its ``n_tokens``);
  * a headerless ``.bin`` without sidecar is read as uint16 unless it looks like text
    (no NUL byte and valid UTF-8 in its first 64 KiB): text is refused with the
    command that tokenizes it.
Every problem is a `DataError` whose message names the file and what to do.
"""
from __future__ import annotations

import json
import os
import pathlib

import numpy as np

from .tokens import H5Tokens, TokenSampler, open_tokens, split_tokens
from ..runtime.console import say

_HDF5_MAGIC = b"\x89HDF\r\n\x1a\n"
_NPY_MAGIC = b"\x93NUMPY"
_LLMC_MAGIC, _LLMC_HEADER = 20240520, 1024
_TEXT_SUFFIXES = (".txt", ".md", ".json", ".jsonl", ".csv", ".py", ".toml", ".yaml", ".yml", ".html")
_SAMPLE_CHUNKS, _CHUNK = 64, 1 << 14  # ~1M ids sampled at start: milliseconds per rank


class DataError(ValueError):
    """Bad training data. runtime's abort hook prints the message alone (no traceback)
    and ends the job with exit code 2, should it surface mid-run on one rank."""

    user_error = True


def _head(path: pathlib.Path, n: int = 1 << 16) -> bytes:
    with open(path, "rb") as f:
        return f.read(n)


def _looks_like_text(head: bytes) -> bool:
    if not head or b"\0" in head:
        return False  # uint16 ids below 256 have a NUL in every other byte
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as e:
        return e.start >= len(head) - 3  # a multi-byte character cut by the 64 KiB read
    return True


def _text_error(spec: str) -> DataError:
    out = pathlib.Path(spec).stem + ".tokens.bin"
    return DataError(
        f"data {spec}: this is a text file, not tokens. Tokenize it first; for bytes as tokens "
        "(vocab 256): python -c \"import numpy as np, zerompi.data as d; "
        f"d.write_tokens('{out}', np.frombuffer(open('{spec}', 'rb').read(), np.uint8), vocab_size=256)\" "
        f"and train with --data {out} (docs/quickstart.md: your own data)")


def open_checked(spec: str):
    """(tokens, description, vocab_size the file declares or None) for `spec`, its format
    detected and checked. Raises DataError."""
    s = os.fspath(spec)
    head_s, sep, tail = s.rpartition(":")
    h5_name = None
    if sep and head_s.lower().endswith((".h5", ".hdf5", ".hdf")):
        s, h5_name = head_s, tail or None
    path = pathlib.Path(s)
    if not path.exists():
        raise DataError(f"data {spec}: no such file")
    if path.is_dir():
        raise DataError(f"data {spec}: a directory; name a token file (.bin, .npy, file.h5:/dataset)")
    size = path.stat().st_size
    if size == 0:
        raise DataError(f"data {spec}: the file is empty")
    head = _head(path)
    try:
        if head.startswith(_HDF5_MAGIC):
            t = H5Tokens(path, h5_name)
            return t, f"HDF5 dataset {t.dset.name} ({t.dtype}, {len(t):,} tokens)", None
        if path.suffix.lower() in (".h5", ".hdf5", ".hdf"):
            raise DataError(f"data {spec}: named like HDF5 but is not an HDF5 file")
        if head.startswith(_NPY_MAGIC):
            t = np.load(path, mmap_mode="r", allow_pickle=False)
            if t.ndim != 1 or t.dtype.kind not in "iu":
                raise DataError(f"data {spec}: .npy holds {t.dtype} of shape {t.shape}; "
                                "need a 1-D integer array")
            return t, f".npy ({t.dtype}, {len(t):,} tokens)", None
        if len(head) >= 12 and int(np.frombuffer(head[:4], "<i4")[0]) == _LLMC_MAGIC:
            _, version, n = (int(v) for v in np.frombuffer(head[:12], "<i4"))
            if version != 1:
                raise DataError(f"data {spec}: llm.c token file version {version}; "
                                "only version 1 (uint16 tokens) is read")
            if size != _LLMC_HEADER + 2 * n:
                raise DataError(f"data {spec}: llm.c header says {n:,} tokens "
                                f"({_LLMC_HEADER + 2 * n:,} bytes) but the file has {size:,} bytes")
            t = np.memmap(path, dtype=np.uint16, mode="r", offset=_LLMC_HEADER, shape=(n,))
            return t, f"llm.c token file (uint16, {n:,} tokens)", None
        meta_path = path.with_suffix(".json")
        if meta_path.exists() and meta_path != path:
            return _zerompi_bin(spec, path, meta_path, size)
        if path.suffix.lower() in _TEXT_SUFFIXES or _looks_like_text(head):
            raise _text_error(spec)
        t = open_tokens(path, dtype="uint16")
        return t, f"headerless .bin, read as uint16 (no {meta_path.name} sidecar; {len(t):,} tokens)", None
    except DataError:
        raise
    except (OSError, ValueError, KeyError) as e:  # h5py, numpy and open_tokens' own checks
        raise DataError(f"data {spec}: {e}") from None


def _zerompi_bin(spec: str, path: pathlib.Path, meta_path: pathlib.Path, size: int):
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError) as e:
        raise DataError(f"data {spec}: sidecar {meta_path.name} is not valid JSON ({e})") from None
    if meta.get("format", "zerompi-tokens") != "zerompi-tokens":
        raise DataError(f"data {spec}: sidecar {meta_path.name} has format {meta.get('format')!r}, "
                        "expected 'zerompi-tokens'")
    dtype = np.dtype(meta.get("dtype", "uint16"))
    if dtype not in (np.dtype(np.uint16), np.dtype(np.uint32)):
        raise DataError(f"data {spec}: sidecar dtype {dtype}; token files are uint16 or uint32")
    n = meta.get("n_tokens")
    if n is not None and int(n) * dtype.itemsize != size:
        raise DataError(f"data {spec}: {size:,} bytes, but {meta_path.name} says {int(n):,} {dtype} "
                        f"tokens ({int(n) * dtype.itemsize:,} bytes): truncated or the wrong sidecar")
    t = open_tokens(path, dtype=dtype)
    return t, f"zerompi token file ({dtype}, {len(t):,} tokens)", meta.get("vocab_size")


def _sample_max(tokens, n: int) -> tuple[int, int, int]:
    """(largest id, smallest id, position of the largest) over a spread of chunks."""
    if n <= _SAMPLE_CHUNKS * _CHUNK:
        starts = [0]
        width = n
    else:
        starts = np.linspace(0, n - _CHUNK, _SAMPLE_CHUNKS).astype(np.int64).tolist()
        width = _CHUNK
    hi, lo, where = -1, 0, 0
    for s in starts:
        a = np.asarray(tokens[int(s): int(s) + width])
        if a.size:
            k = int(a.argmax())
            if int(a[k]) > hi:
                hi, where = int(a[k]), int(s) + k
            lo = min(lo, int(a.min()))
    return hi, lo, where


def check_source(spec: str, vocab_size: int, block_size: int, val_fraction: float, need_val: bool):
    """Open and check `spec` for a model with `vocab_size` ids and `block_size`-token
    windows. Returns (tokens, one-line description); raises DataError."""
    tokens, what, meta_vocab = open_checked(spec)
    n = len(tokens)
    if isinstance(meta_vocab, int) and meta_vocab > vocab_size:
        raise DataError(f"data {spec}: tokenized for vocab_size {meta_vocab} (its .json sidecar) but the model "
                        f"has {vocab_size}: set model.vocab_size = {meta_vocab}")
    hi, lo, where = _sample_max(tokens, n)
    if lo < 0:
        raise DataError(f"data {spec}: negative token ids; token ids are 0 .. vocab_size-1")
    if hi >= vocab_size:
        raise DataError(f"data {spec}: token id {hi} at position {where:,} is >= the model's vocab_size "
                        f"{vocab_size}: set model.vocab_size (at least {hi + 1}) or use data "
                        "tokenized for this model")
    train, val = split_tokens(tokens, val_fraction)
    if len(train) < block_size + 1 or (need_val and len(val) < block_size + 1):
        raise DataError(f"data {spec}: {n:,} tokens: the {'validation' if len(train) > block_size else 'training'}"
                        f" split (val_fraction {val_fraction}) is shorter than block_size+1 = {block_size + 1}")
    sampled = min(n, _SAMPLE_CHUNKS * _CHUNK)
    return tokens, f"{what}; ids < {vocab_size} in a {sampled:,}-token sample, the rest checked as read"


class CheckedSampler(TokenSampler):
    """TokenSampler that checks every batch it reads against the vocabulary: the lazy
    half of the check (one max over ids already in memory per micro-batch)."""

    def __init__(self, tokens, block_size: int, seed: int = 0, *, vocab_size: int, spec: str = "data"):
        super().__init__(tokens, block_size, seed)
        self.vocab_size, self.spec = vocab_size, spec

    def _gather(self, offs):
        x, y = super()._gather(offs)
        if x.numel():
            hi = max(int(x.max()), int(y[:, -1].max()))
            lo = min(int(x.min()), int(y[:, -1].min()))
            if hi >= self.vocab_size or lo < 0:
                bad = hi if hi >= self.vocab_size else lo
                row = int(((x == bad).any(1) | (y[:, -1] == bad)).nonzero()[0, 0])
                raise DataError(f"data {self.spec}: token id {bad} (vocab_size {self.vocab_size}) in the "
                                f"window starting at token {int(offs[row]):,}: found while training "
                                "(the start-up sample missed it); fix the data or model.vocab_size")
        return x, y


def open_agreed(spec: str, vocab_size: int, block_size: int, val_fraction: float, need_val: bool, comm):
    """check_source on every rank (each needs its own memmap anyway), failures agreed
    (runtime.agree), so all ranks go on or all stop: tokens, or None after rank 0 printed
    the job's one error line. Collective over `comm`."""
    from .. import runtime

    tokens = error = what = None
    try:
        tokens, what = check_source(spec, vocab_size, block_size, val_fraction, need_val)
    except DataError as e:
        error = e
    errors = runtime.agree(comm, error)
    if errors:
        say(f"error: {errors[0][2]}", rank=comm.rank, prog="zerompi.train")
    else:
        say(f"data {spec}: {what}", rank=comm.rank, prog="zerompi.train", err=False)
    return None if errors else tokens
