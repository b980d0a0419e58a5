"""Check a training data source before the first step, and every batch during training.

A bad --data used to surface late: a text file trained as uint16 "tokens" until an
IndexError deep in the embedding, once per rank. Here the source's format is detected
from its bytes (not trusted from its name), its size and dtype are checked against that
format (here, per file), and a sample of token ids is checked against the model's
vocabulary (sources.check_data, over all the files `data` names); the whole
file is then checked lazily, batch by batch, as training reads it (`CheckedSampler`),
so no start-up pass over a multi-GB file is needed.

Formats (detected in this order):
  * HDF5 (magic ``\\x89HDF``): ``file.h5`` or ``file.h5:/dataset``, a 1-D integer dataset;
    prepare's shards (``tokens`` + ``doc_offsets``, docs/data.md) with their documents;
  * ``.npy`` (magic ``\\x93NUMPY``): a 1-D integer array, memory-mapped;
  * llm.c token shards (int32 header: magic 20240520 version 1 with uint16 tokens, or
    magic 20240801 version 7 with uint32 tokens; token count; tokens from byte 1024);
  * Megatron-LM indexed data: ``name.bin`` beside ``name.idx`` (MMIDIDX header: dtype,
    sequence sizes and pointers, document index); documents come from the index;
  * zerompi ``.bin`` (uint16/uint32, dtype from the ``.json`` sidecar that
    zerompi.data.write_tokens writes; size must match its ``n_tokens``);
  * a headerless ``.bin`` without sidecar: text (no NUL byte and valid UTF-8 in its first
    64 KiB) is refused with the command that tokenizes it; tokens are read only with
    their dtype named (the trainer's ``data_dtype`` key), else refused: a uint32 file read
    as uint16 trains on garbage without any other sign. As a second guard, a file read as
    uint16 whose every other id is 0 in its first MB (the uint32 pattern) is refused.
Every problem is a `DataError` whose message names the file and what to do.
"""
from __future__ import annotations

import json
import os
import pathlib
from dataclasses import dataclass

import numpy as np

from .tokens import H5Tokens, TokenSampler, open_tokens

_HDF5_MAGIC = b"\x89HDF\r\n\x1a\n"
_NPY_MAGIC = b"\x93NUMPY"
_LLMC_HEADER = 1024
_LLMC = {20240520: (1, np.uint16), 20240801: (7, np.uint32)}  # magic: (version, token dtype)
_MEGATRON_MAGIC = b"MMIDIDX\x00\x00"
# Megatron's dtype codes (megatron/core/datasets/indexed_dataset.py, DType)
_MEGATRON_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16}
DTYPES = ("uint8", "uint16", "uint32", "int32")  # what data_dtype may name
_PATTERN_IDS = 1 << 19  # uint16 ids (1 MB) looked at for the uint32-as-uint16 pattern
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
    out = pathlib.Path(spec).stem + "-tokens"
    return DataError(
        f"data {spec}: this is a text file, not tokens. Tokenize it first (bytes as tokens, vocab 256; "
        f"--tokenizer for another): python -m zerompi.prepare {spec} --out {out} and train with --data {out} "
        "(docs/data.md)")


@dataclass
class Source:
    """One opened token file: its ids, a description, the vocabulary size it declares
    (None: unknown) and the token offsets where its documents start (None: unknown)."""
    tokens: object
    what: str
    vocab: int | None = None
    doc_starts: np.ndarray | None = None
    tokenizer: str | None = None  # the tokenizer's sha256, where the file records it (prepare's shards)


def open_checked(spec: str, dtype: str | None = None):
    """(tokens, description, vocab_size the file declares or None) for `spec`, its format
    detected and checked; `dtype` is what a headerless file holds. Raises DataError."""
    src = open_source(spec, dtype)
    return src.tokens, src.what, src.vocab


def open_source(spec: str, dtype: str | None = None, docs: bool = True) -> Source:
    """`spec` (file, file.h5 or file.h5:/dataset) opened as a Source; its document starts
    only with `docs` (they take 8 bytes a document on every rank). Raises DataError."""
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
            return _h5_source(spec, path, h5_name, docs)
        if path.suffix.lower() in (".h5", ".hdf5", ".hdf"):
            raise DataError(f"data {spec}: named like HDF5 but is not an HDF5 file")
        if head.startswith(_NPY_MAGIC):
            t = np.load(path, mmap_mode="r", allow_pickle=False)
            if t.ndim != 1 or t.dtype.kind not in "iu":
                raise DataError(f"data {spec}: .npy holds {t.dtype} of shape {t.shape}; "
                                "need a 1-D integer array")
            return Source(t, f".npy ({t.dtype}, {len(t):,} tokens)")
        magic = int(np.frombuffer(head[:4], "<i4")[0]) if len(head) >= 12 else None
        if magic in _LLMC:
            _, version, n = (int(v) for v in np.frombuffer(head[:12], "<i4"))
            want, dt = _LLMC[magic]
            if version != want:
                raise DataError(f"data {spec}: llm.c token file (magic {magic}) version {version}; "
                                f"only version {want} is read")
            width = np.dtype(dt).itemsize
            if size != _LLMC_HEADER + width * n:
                raise DataError(f"data {spec}: llm.c header says {n:,} tokens "
                                f"({_LLMC_HEADER + width * n:,} bytes) but the file has {size:,} bytes")
            t = np.memmap(path, dtype=dt, mode="r", offset=_LLMC_HEADER, shape=(n,))
            return Source(t, f"llm.c token file ({np.dtype(dt).name}, {n:,} tokens)")
        if path.with_suffix(".idx").exists() and path.suffix == ".bin":
            return _megatron(spec, path, path.with_suffix(".idx"), size, docs)
        meta_path = path.with_suffix(".json")
        if meta_path.exists() and meta_path != path:
            return _zerompi_bin(spec, path, meta_path, size)
        if path.suffix.lower() in _TEXT_SUFFIXES or _looks_like_text(head):
            raise _text_error(spec)
        if not dtype:
            raise DataError(f"data {spec}: a headerless token file (no header, no {meta_path.name} sidecar): "
                            f"name its dtype with data_dtype = {' | '.join(DTYPES)}")
        if dtype not in DTYPES:
            raise DataError(f"data_dtype {dtype!r}: must be one of {', '.join(DTYPES)}")
        if size % np.dtype(dtype).itemsize:
            raise DataError(f"data {spec}: {size:,} bytes is not a multiple of {np.dtype(dtype).itemsize} "
                            f"bytes (data_dtype = {dtype})")
        t = np.memmap(path, dtype=dtype, mode="r")
        _refuse_uint32_pattern(spec, t, f"data_dtype = {dtype}")
        return Source(t, f"headerless .bin, {dtype} (data_dtype; {len(t):,} tokens)")
    except DataError:
        raise
    except (OSError, ValueError, KeyError) as e:  # h5py, numpy and open_tokens' own checks
        raise DataError(f"data {spec}: {e}") from None


def _refuse_uint32_pattern(spec: str, tokens, why: str) -> None:
    """uint32 ids below 65,536 read as uint16 put a 0 in every other place: refuse that."""
    if np.dtype(tokens.dtype) != np.uint16:
        return
    a = np.asarray(tokens[:_PATTERN_IDS])
    if len(a) >= 64 and not a[1::2].any() and a[0::2].any():
        raise DataError(f"data {spec}: read as uint16 ({why}) every other id in the first MB is 0, the "
                        "pattern of uint32 tokens: if the file holds uint32, say data_dtype = uint32")


def _h5_source(spec: str, path: pathlib.Path, name: str | None, docs: bool) -> Source:
    import h5py

    with h5py.File(path, "r") as f:  # prepare's shards: "tokens" + "doc_offsets" (docs/data.md)
        ours = name is None and isinstance(f.get("tokens"), h5py.Dataset) and "doc_offsets" in f
        attrs = dict(f.attrs) if ours else {}
        n_docs = f["doc_offsets"].shape[0] - 1 if ours else 0
        offsets = np.asarray(f["doc_offsets"][:], np.int64) if ours and docs else None
        d = f["tokens"] if ours else None
        at = d.id.get_offset() if d is not None and d.shape[0] else None  # None: not contiguous, or empty
        dt, n = (d.dtype, d.shape[0]) if d is not None else (None, 0)
    # a contiguous shard is read as a memmap: cheaper per window than an HDF5 read, no HDF5 handle kept
    t = np.memmap(path, dtype=dt, mode="r", offset=at, shape=(n,)) if at is not None and dt.isnative \
        else H5Tokens(path, "tokens" if ours else name)
    vocab = int(attrs["vocab_size"]) if "vocab_size" in attrs else None
    what = (f"zerompi shard ({t.dtype}, {len(t):,} tokens, {n_docs:,} documents, "
            f"tokenizer {attrs.get('tokenizer', '?')})" if ours else f"HDF5 dataset {t.dset.name} ({t.dtype}, "
            f"{len(t):,} tokens)")
    if offsets is not None and (len(offsets) == 0 or offsets[0] != 0 or offsets[-1] != len(t) or (np.diff(offsets) < 0).any()):
        raise DataError(f"data {spec}: doc_offsets do not run from 0 to the {len(t):,} tokens: a damaged shard")
    return Source(t, what, vocab, offsets[:-1] if offsets is not None else None,
                  str(attrs["tokenizer_sha256"]) if "tokenizer_sha256" in attrs else None)


def _megatron(spec: str, path: pathlib.Path, idx: pathlib.Path, size: int, docs: bool) -> Source:
    with open(idx, "rb") as f:
        head = f.read(34)
        if len(head) < 34 or not head.startswith(_MEGATRON_MAGIC):
            raise DataError(f"data {spec}: {idx.name} beside it is not a Megatron index (MMIDIDX)")
        version, code, n_seq, n_doc = (int(np.frombuffer(head[9:17], "<u8")[0]), head[17],
                                       int(np.frombuffer(head[18:26], "<u8")[0]),
                                       int(np.frombuffer(head[26:34], "<u8")[0]))
    if version != 1 or code not in _MEGATRON_DTYPES:
        raise DataError(f"data {spec}: Megatron index {idx.name} version {version}, dtype code {code}: "
                        "only version 1 with integer tokens is read")
    dt = np.dtype(_MEGATRON_DTYPES[code])
    body = np.memmap(idx, mode="r", offset=34)
    sizes = np.frombuffer(body, np.int32, n_seq)
    pointers = np.frombuffer(body, np.int64, n_seq, offset=4 * n_seq)
    doc_idx = np.frombuffer(body, np.int64, n_doc, offset=12 * n_seq)
    n = int(sizes.sum(dtype=np.int64))
    if size != n * dt.itemsize:
        raise DataError(f"data {spec}: {idx.name} says {n:,} {dt} tokens ({n * dt.itemsize:,} bytes) "
                        f"but the file has {size:,} bytes")
    t = np.memmap(path, dtype=dt, mode="r")
    # doc_idx ends with n_seq (one past the last sequence)
    starts = np.asarray(pointers[doc_idx[doc_idx < n_seq]] // dt.itemsize, np.int64) if docs else None
    return Source(t, f"Megatron indexed data ({dt}, {n:,} tokens, {max(0, n_doc - 1):,} documents)", None, starts)


def _zerompi_bin(spec: str, path: pathlib.Path, meta_path: pathlib.Path, size: int) -> Source:
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
    return Source(t, f"zerompi token file ({dtype}, {len(t):,} tokens)", meta.get("vocab_size"))


def sample_max(tokens, n: int) -> tuple[int, int, int]:
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


class CheckedSampler(TokenSampler):
    """TokenSampler that checks every batch it reads against the vocabulary: the lazy
    half of the check (one max over ids already in memory per micro-batch)."""

    def __init__(self, tokens, block_size: int, seed: int = 0, *, vocab_size: int, spec: str = "data", **kw):
        super().__init__(tokens, block_size, seed, **kw)
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
