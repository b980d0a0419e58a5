"""Names, HDF5 types and small file helpers shared by the checkpoint writer and readers.

No torch here: `python -m zerompi.inspect` and the verifier import only h5py/numpy, so
they start fast and run on machines without the training stack. Durable writes and
fsync come from zerompi.runtime.fileio, agreeing on errors from zerompi.runtime.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from .. import runtime
from ..runtime.fileio import fsync_path

FORMAT = "zerompi-checkpoint"
# Version 2: the manifest's "files" and "index" entries carry "digest" (CRC-32 per 64 MiB
# block, DIGEST_ALGO) instead of version 1's "sha256"; a reader of version 1 only would
# fail on the missing key, hence the bump. Everything else is unchanged, and this
# zerompi reads both (version-1 manifests with "sha256" or, written between the two,
# "digest" entries: file_matches checks whichever is there).
VERSION = 2
READS_VERSIONS = (1, 2)
MANIFEST = "manifest.json"
INDEX = "index.h5"
LATEST = "latest"
TMP_PREFIX = ".tmp-"      # DIR/.tmp-TAG-XXXX: a save in progress (or one that crashed)
OLD_PREFIX = ".old-"      # DIR/.old-TAG-XXXX: a checkpoint moved aside while TAG is replaced
# HDF5's own file locks (flock) are off for every file we open: the save protocol never
# has a reader and a writer on one file, and flock fails on some parallel file systems
# (Lustre mounted without flock), which users otherwise meet as "unable to lock file".
# Upper bound on the HDF5 file format: files stay readable by HDF5 1.10 tools
# (Debian's h5ls/h5dump), although pip h5py ships a newer library.
LIBVER = ("earliest", "v110")
STATE_GROUP = "state"      # rank file: /state/<kind> = concatenated pieces (1-D)
MODULE_GROUP = "module"    # frozen parameters and buffers (rank 0's file only)
_HASH_BLOCK = 8 << 20


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, corrupt or does not fit the model."""


_MAX_LISTED = 8


def raise_agreed(comm, errors, context: str) -> None:
    """runtime.raise_agreed with checkpoint problems raised as CheckpointError."""
    runtime.raise_agreed(comm, errors, context, exc_type=CheckpointError, limit=_MAX_LISTED)


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.h5"


def lowp_kind(precision: str) -> str | None:
    """Name of the optional low-precision parameter copy (/param_bf16, /param_fp16)."""
    return {"bf16": "param_bf16", "fp16": "param_fp16"}.get(precision)


def link_name(name: str) -> str:
    """HDF5 link name of a tensor: dots are legal in HDF5 names and kept ("body.0.weight");
    '/' would create groups and '%' is the escape, so both are percent-encoded."""
    return name.replace("%", "%25").replace("/", "%2F")


_TAG_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.+=,@-]{0,199}$")


def check_tag(tag: str) -> str:
    if not isinstance(tag, str) or not _TAG_RE.match(tag) or tag == LATEST:
        raise ValueError(f"checkpoint tag {tag!r}: use letters, digits and _.+=,@- "
                         f"(not starting with '.' or '-', not {LATEST!r})")
    return tag


# ------------------------------------------------------------------ HDF5 types
def bf16_type():
    """bfloat16 as a custom HDF5 float: 1 sign, 8 exponent (bias 127), 7 mantissa bits.
    h5dump prints its values and h5py reads it as float32 (HDF5 converts)."""
    import h5py

    t = h5py.h5t.IEEE_F32LE.copy()
    t.set_fields(15, 7, 8, 0, 7)   # sign pos, exponent pos/size, mantissa pos/size
    t.set_offset(0)
    t.set_precision(16)
    t.set_size(2)
    t.set_ebias(127)
    return t


def lowp_h5type(kind: str):
    import h5py

    return bf16_type() if kind == "param_bf16" else h5py.h5t.IEEE_F16LE.copy()


# ------------------------------------------------------------------ files
def sha256_file(path: str) -> tuple[str, int]:
    """(hex digest, size in bytes), reading in blocks (memory independent of the file)."""
    h, n = hashlib.sha256(), 0
    buf = bytearray(_HASH_BLOCK)
    mv = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while True:
            k = f.readinto(mv)
            if not k:
                break
            h.update(mv[:k])
            n += k
    return h.hexdigest(), n


# File checksums: CRC-32 of every 64 MiB block (zlib: ~2-5 GB/s per core, vs ~0.5-0.9
# GB/s for sha256). It guards against corruption (flipped bits, torn or replaced blocks),
# not against tampering; the manifest keeps its own sha256. Files of checkpoints that
# recorded "sha256" (format version 1) are still checked with it. The writer computes the
# block checksums from memory while it writes (BlockCRC); digest_file computes the same
# value from a file on disk (load-time verification, index.h5).
DIGEST_ALGO = "crc32/64MiB"
_DIGEST_BLOCK = 64 << 20
_READ_CHUNK = 4 << 20      # reads while verifying: a reused buffer that stays in cache


class BlockCRC:
    """CRC-32 of each _DIGEST_BLOCK block of a byte stream fed in order, in pieces of any
    size (zlib.crc32 chains and releases the GIL); digest() gives digest_file's string."""

    def __init__(self) -> None:
        self.block = _DIGEST_BLOCK
        self.crcs: list[int] = []
        self.crc = 0
        self.size = 0          # bytes fed so far

    def update(self, data) -> None:
        mv = memoryview(data).cast("B")
        while len(mv):
            room = self.block - self.size % self.block
            part = mv[:room]
            self.crc = zlib.crc32(part, self.crc)
            self.size += len(part)
            mv = mv[len(part):]
            if self.size % self.block == 0:
                self.crcs.append(self.crc)
                self.crc = 0

    def digest(self) -> str:
        crcs = self.crcs + ([self.crc] if self.size % self.block else [])
        return f"{DIGEST_ALGO}:" + "".join(f"{c:08x}" for c in crcs)


def hash_threads(ranks_here: int = 1) -> int:
    """Threads for one rank's checksum pass: this machine's CPUs shared by its ranks."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(8, cpus // max(1, ranks_here)))


def _pread_into(fd: int, mv: memoryview, pos: int, path: str) -> None:
    got = 0
    while got < len(mv):
        k = os.preadv(fd, [mv[got:]], pos + got)
        if k == 0:
            raise OSError(f"{path}: shorter than expected while reading (offset {pos + got})")
        got += k


def crc_range(fd: int, lo: int, hi: int, crc: BlockCRC, path: str = "file", buf: bytearray | None = None) -> None:
    """Feed bytes [lo, hi) of an open file to `crc`, through one small reused buffer."""
    buf = buf if buf is not None else bytearray(min(_READ_CHUNK, max(1, hi - lo)))
    mv = memoryview(buf)
    while lo < hi:
        v = mv[:min(len(mv), hi - lo)]
        _pread_into(fd, v, lo, path)
        crc.update(v)
        lo += len(v)


def digest_file(path: str, threads: int = 1) -> tuple[str, int]:
    """("crc32/64MiB:<crc of each block, hex>", size). Each block is read in 4 MiB reads
    into one reused buffer per thread (checksummed while in cache, no block-sized
    allocation); os.preadv and zlib.crc32 release the GIL, so `threads` blocks at once."""
    size = os.path.getsize(path)
    nblocks = -(-size // _DIGEST_BLOCK)
    local = threading.local()
    fd = os.open(path, os.O_RDONLY)
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)

    def crc(i: int) -> int:
        buf = getattr(local, "buf", None)
        if buf is None:
            buf = local.buf = memoryview(bytearray(min(_READ_CHUNK, max(1, size))))
        c, lo, hi = 0, i * _DIGEST_BLOCK, min(size, (i + 1) * _DIGEST_BLOCK)
        while lo < hi:
            v = buf[:min(len(buf), hi - lo)]
            _pread_into(fd, v, lo, path)
            c = zlib.crc32(v, c)
            lo += len(v)
        return c

    try:
        if threads > 1 and nblocks > 1:
            with ThreadPoolExecutor(min(threads, nblocks)) as ex:
                crcs = list(ex.map(crc, range(nblocks)))
        else:
            crcs = [crc(i) for i in range(nblocks)]
    finally:
        os.close(fd)
    return f"{DIGEST_ALGO}:" + "".join(f"{c:08x}" for c in crcs), size


def file_matches(path: str, info: dict, threads: int = 1) -> tuple[bool, str]:
    """(matches, algorithm name) against a manifest entry: "digest", or "sha256" of
    checkpoints written before the block checksums."""
    if "digest" in info:
        return digest_file(path, threads)[0] == info["digest"], "crc32"
    return sha256_file(path)[0] == info["sha256"], "sha256"


def fsync_and_hash(path: str, threads: int = 1) -> tuple[str, int]:
    """fsync a freshly written file while checksumming it: the flush to disk and the
    checksum pass (CPU, from the page cache) overlap; both release the GIL."""
    errors: list[BaseException] = []

    def sync() -> None:
        try:
            fsync_path(path)
        except BaseException as e:  # re-raised below, in the caller's thread
            errors.append(e)

    t = threading.Thread(target=sync, name="zerompi-fsync")
    t.start()
    try:
        result = digest_file(path, threads)
    finally:
        t.join()
    if errors:
        raise errors[0]
    return result


# ------------------------------------------------------------------ JSON
def _json_path_error(obj: Any, path: str) -> str | None:
    """First place in obj that does not survive a JSON round trip, as a readable path."""
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return None
    if isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            bad = _json_path_error(v, f"{path}[{i}]")
            if bad:
                return bad
        return None
    if isinstance(obj, dict):
        for k, v in obj.items():
            if not isinstance(k, str):
                return f"{path}: key {k!r} is a {type(k).__name__}, JSON keys must be str"
            bad = _json_path_error(v, f"{path}[{k!r}]")
            if bad:
                return bad
        return None
    return f"{path}: {type(obj).__name__} is not JSON-serialisable"


def client_state_json(client_state: Any) -> str:
    """JSON text of client_state; TypeError naming the offending key otherwise. Only
    JSON is stored so that loading can never execute code (no pickle)."""
    if client_state is None:
        client_state = {}
    if not isinstance(client_state, dict):
        raise TypeError(f"client_state must be a dict, got {type(client_state).__name__}")
    bad = _json_path_error(client_state, "client_state")
    if bad:
        raise TypeError(bad + " (store plain numbers, strings, lists and dicts)")
    return json.dumps(client_state)


def canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def seal(manifest: dict) -> dict:
    """Add a checksum over the manifest itself so a damaged manifest.json is detected."""
    body = {k: v for k, v in manifest.items() if k != "checksum"}
    return dict(body, checksum=hashlib.sha256(canonical(body)).hexdigest())


def unseal(text: bytes, where: str) -> dict:
    try:
        m = json.loads(text)
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{where}: not valid JSON ({e})") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise CheckpointError(f"{where}: not a zerompi checkpoint manifest")
    if m.get("format_version") not in READS_VERSIONS:
        raise CheckpointError(f"{where}: format version {m.get('format_version')!r}, "
                              f"this zerompi reads versions {', '.join(map(str, READS_VERSIONS))}")
    body = {k: v for k, v in m.items() if k != "checksum"}
    if hashlib.sha256(canonical(body)).hexdigest() != m.get("checksum"):
        raise CheckpointError(f"{where}: checksum mismatch (the manifest is damaged)")
    return m


# ------------------------------------------------------------------ flat ranges
def flat_blocks(shape: tuple[int, ...], lo: int, hi: int) -> list[tuple[tuple, tuple]]:
    """Cut the row-major element range [lo, hi) of an array of `shape` into rectangular
    blocks (start, count), in flat order, each contiguous in row-major order. A piece of a
    parameter becomes at most 2*ndim-1 hyperslabs of the full-shape virtual dataset."""
    out: list[tuple[tuple, tuple]] = []

    def rec(dims: tuple[int, ...], lo: int, hi: int, prefix: tuple) -> None:
        if lo >= hi:
            return
        ones = (1,) * len(prefix)
        if len(dims) == 1:
            out.append((prefix + (lo,), ones + (hi - lo,)))
            return
        inner = int(np.prod(dims[1:]))
        i0, r0 = divmod(lo, inner)
        i1, r1 = divmod(hi, inner)
        if i0 == i1:
            rec(dims[1:], r0, r1, prefix + (i0,))
            return
        if r0:
            rec(dims[1:], r0, inner, prefix + (i0,))
            i0 += 1
        if i1 > i0:
            out.append((prefix + (i0,) + (0,) * (len(dims) - 1), ones + (i1 - i0,) + tuple(dims[1:])))
        if r1:
            rec(dims[1:], 0, r1, prefix + (i1,))

    rec(tuple(int(d) for d in shape) or (1,), int(lo), int(hi), ())
    return out
