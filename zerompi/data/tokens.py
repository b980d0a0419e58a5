"""Token datasets and deterministic, world-size-independent batch sampling.

Pure numpy/h5py/torch (imported where batches are made, so that `python -m
zerompi.prepare` starts without it): nothing here knows about MPI or ZeRO.

Sources (see :func:`open_tokens`):
  * ``"default"``: byte-level tokens of this Python's stdlib sources, built
    once and cached (no download);
  * ``path.bin``: flat uint16/uint32 token file (dtype from a ``path.json``
    sidecar or the ``dtype`` argument);
  * ``file.h5:/dataset``: a 1-D integer HDF5 dataset.
"""
from __future__ import annotations

import hashlib
import json
import os
import pathlib
import sys
import sysconfig
from typing import TYPE_CHECKING, Any, Protocol, Sequence

import numpy as np

from ..runtime.fileio import atomic_write

if TYPE_CHECKING:
    import torch

__all__ = [
    "DEFAULT_MAX_BYTES", "Tokens", "H5Tokens", "TokenRange", "cache_dir_path",
    "default_corpus", "write_tokens", "open_tokens", "split_tokens",
    "shard_range", "TokenSampler",
]

DEFAULT_MAX_BYTES = 16 * 1024 * 1024
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "__pycache__"}
_H5_SUFFIXES = (".h5", ".hdf5", ".hdf")


class Tokens(Protocol):
    """What the samplers need: a 1-D integer sequence with length and slicing."""

    def __len__(self) -> int: ...
    def __getitem__(self, key: slice) -> Any: ...


# ---------------------------------------------------------------- default corpus

def cache_dir_path(cache_dir: str | os.PathLike[str] | None = None) -> pathlib.Path:
    """Argument, else ``$ZEROMPI_CACHE``, else ``~/.cache/zerompi``."""
    if cache_dir is None:
        cache_dir = os.environ.get("ZEROMPI_CACHE") or pathlib.Path.home() / ".cache" / "zerompi"
    return pathlib.Path(cache_dir).expanduser()


def _stdlib_files() -> list[pathlib.Path]:
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    out: list[pathlib.Path] = []
    for dirpath, dirnames, filenames in os.walk(root, onerror=lambda e: None):
        # Sorting in place fixes the walk order, so the corpus is reproducible.
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        out.extend(pathlib.Path(dirpath, f) for f in sorted(filenames) if f.endswith(".py"))
    return out


def _meta_path(bin_path: pathlib.Path) -> pathlib.Path:
    return bin_path.with_suffix(".json")


def default_corpus(
    cache_dir: str | os.PathLike[str] | None = None, max_bytes: int = DEFAULT_MAX_BYTES
) -> pathlib.Path:
    """Path of the cached stdlib byte corpus (uint16 ``.bin`` + ``.json`` meta).

    Built on first use: ``*.py`` files under the stdlib in sorted walk order,
    joined by ``b"\\n"``, truncated to ``max_bytes``. Safe to call from many
    processes at once. The meta's ``sha256`` is of the raw byte stream.
    """
    if max_bytes <= 0:
        raise ValueError("max_bytes must be positive")
    d = cache_dir_path(cache_dir)
    d.mkdir(parents=True, exist_ok=True)
    ver = "{}.{}.{}".format(*sys.version_info[:3])
    dest = d / f"stdlib-py{ver}-{max_bytes}.bin"
    meta_path = _meta_path(dest)
    if dest.exists() and meta_path.exists():
        try:
            meta = json.loads(meta_path.read_text())
            if dest.stat().st_size == 2 * int(meta["n_tokens"]):
                return dest
        except (OSError, ValueError, KeyError):
            pass  # damaged cache: rebuild below

    parts: list[bytes] = []
    total = n_files = 0
    for p in _stdlib_files():
        if total >= max_bytes:
            break
        try:
            b = p.read_bytes()
        except OSError:
            continue
        chunk = (b"\n" if parts else b"") + b
        parts.append(chunk)
        total += len(chunk)
        n_files += 1
    raw = b"".join(parts)[:max_bytes]
    if not raw:
        raise RuntimeError("no readable stdlib .py files found")
    meta = {
        "format": "zerompi-tokens", "source": "python-stdlib", "python_version": ver,
        "dtype": "uint16", "vocab_size": 256, "file_count": n_files,
        "byte_count": len(raw), "n_tokens": len(raw), "max_bytes": max_bytes,
        "sha256": hashlib.sha256(raw).hexdigest(),
    }
    # Meta first: the .bin's existence is what marks the cache complete.
    # Concurrent builders write identical bytes, so whichever rename lands last is fine.
    atomic_write(meta_path, (json.dumps(meta, indent=1) + "\n").encode())
    atomic_write(dest, np.frombuffer(raw, dtype=np.uint8).astype(np.uint16).tobytes())
    return dest


# ---------------------------------------------------------------- token files

def write_tokens(
    path: str | os.PathLike[str], tokens: np.ndarray | Sequence[int],
    dtype: str | np.dtype = "uint16", **meta: Any,
) -> pathlib.Path:
    """Write a flat ``.bin`` token file plus its ``.json`` sidecar (atomically)."""
    path = pathlib.Path(path)
    arr = np.asarray(tokens)
    dt = np.dtype(dtype)
    if arr.size and (arr.min() < 0 or arr.max() > np.iinfo(dt).max):
        raise ValueError(f"token values do not fit in {dt}")
    path.parent.mkdir(parents=True, exist_ok=True)
    info = {"format": "zerompi-tokens", "dtype": dt.name, "n_tokens": int(arr.size), **meta}
    atomic_write(_meta_path(path), (json.dumps(info, indent=1) + "\n").encode())
    atomic_write(path, arr.astype(dt).tobytes())
    return path


class H5Tokens:
    """A 1-D HDF5 integer dataset; slicing reads from disk into numpy."""

    def __init__(self, path: str | os.PathLike[str], name: str | None = None) -> None:
        import h5py  # lazy: only needed for HDF5 sources

        self.file = h5py.File(path, "r")
        if name is None:
            names: list[str] = []
            self.file.visititems(lambda n, o: names.append(n) if isinstance(o, h5py.Dataset) else None)
            if len(names) != 1:
                self.file.close()
                raise ValueError(f"{path}: name a dataset (file:/name); found {names}")
            name = names[0]
        self.dset = self.file[name]
        if self.dset.ndim != 1 or self.dset.dtype.kind not in "iu":
            self.file.close()
            raise ValueError(f"{path}:{name} must be a 1-D integer dataset")
        self.dtype = self.dset.dtype

    def __len__(self) -> int:
        return int(self.dset.shape[0])

    def __getitem__(self, key: Any) -> np.ndarray:
        return self.dset[key]

    def close(self) -> None:
        self.file.close()


class TokenRange:
    """Lazy contiguous view ``base[start:stop]`` of a non-numpy token source."""

    def __init__(self, base: Tokens, start: int, stop: int) -> None:
        self.base, self.start, self.stop = base, start, stop
        self.dtype = getattr(base, "dtype", None)

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, key: slice) -> np.ndarray:
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError("TokenRange supports contiguous slices only")
        a, b, _ = key.indices(len(self))
        return np.asarray(self.base[self.start + a: self.start + max(a, b)])


def open_tokens(
    spec: str | os.PathLike[str], *, dtype: str | np.dtype | None = None,
    cache_dir: str | os.PathLike[str] | None = None, max_bytes: int = DEFAULT_MAX_BYTES,
) -> Tokens:
    """Open ``"default"``, a ``.bin`` path, or ``file.h5:/dataset``.

    ``.bin`` returns a read-only ``np.memmap``; its dtype is ``dtype`` if given,
    else the sidecar ``<name>.json`` ``"dtype"``, else uint16. HDF5 returns
    :class:`H5Tokens` (dataset name optional if the file holds exactly one).
    """
    s = os.fspath(spec)
    if s == "default":
        return open_tokens(default_corpus(cache_dir, max_bytes), dtype=dtype)
    head, sep, tail = s.rpartition(":")
    if sep and head.lower().endswith(_H5_SUFFIXES):
        return H5Tokens(head, tail or None)
    if s.lower().endswith(_H5_SUFFIXES):
        return H5Tokens(s)
    path = pathlib.Path(s)
    if dtype is None:
        mp = _meta_path(path)
        dtype = json.loads(mp.read_text()).get("dtype", "uint16") if mp.exists() else "uint16"
    dt = np.dtype(dtype)
    if dt not in (np.dtype(np.uint16), np.dtype(np.uint32)):
        raise ValueError(f"{path}: token dtype must be uint16 or uint32, got {dt}")
    if path.stat().st_size % dt.itemsize:
        raise ValueError(f"{path}: size is not a multiple of {dt.itemsize} bytes")
    return np.memmap(path, dtype=dt, mode="r")


def split_tokens(tokens: Tokens, val_fraction: float = 0.05) -> tuple[Tokens, Tokens]:
    """(train, val): val is the last ``floor(len * val_fraction)`` tokens."""
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError("val_fraction must be in [0, 1)")
    n = len(tokens)
    cut = n - int(n * val_fraction)
    if isinstance(tokens, np.ndarray):
        return tokens[:cut], tokens[cut:]
    return TokenRange(tokens, 0, cut), TokenRange(tokens, cut, n)


# ---------------------------------------------------------------- sampling

def shard_range(n: int, part: int, parts: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` of part ``part`` when ``n`` rows are split into
    ``parts`` contiguous pieces; the first ``n % parts`` pieces get one extra."""
    if not 0 <= part < parts:
        raise ValueError(f"part {part} out of range for {parts} parts")
    q, r = divmod(n, parts)
    start = part * q + min(part, r)
    return start, start + q + (part < r)


class TokenSampler:
    """Deterministic (x, y) batches of ``block_size`` windows from ``tokens``.

    Train step ``s``: the global batch's start offsets are drawn from
    ``np.random.default_rng([seed, s])``, so they depend on (seed, s, global
    batch size) only. Layout of a step: the global batch (row order = offset
    order) is cut into ``grad_accum`` contiguous micro-batches, then each
    micro-batch into ``world`` contiguous rank slices, both by
    :func:`shard_range`. Concatenating ranks 0..N-1 of micro 0, then of
    micro 1, ... reproduces the global batch for any N. Ranks may receive
    unequal (even zero) rows; weight per-rank mean losses by :meth:`rows` /
    ``global_batch`` for an exact global mean.

    ``order="epoch"``: the step's rows are the next ``global_batch`` sample positions of
    an epoch walk over the non-overlapping windows (data/epoch.py), counted from
    :meth:`resume_at`'s position; the row layout is the same.

    Eval batches (:meth:`eval_batch`) use sequential non-overlapping windows.
    ``doc_starts`` (sorted token offsets where documents start) enables :meth:`doc_ids`.
    """

    def __init__(self, tokens: Tokens, block_size: int, seed: int = 0, *, order: str = "random",
                 doc_starts: np.ndarray | None = None) -> None:
        if len(tokens) < block_size + 1:
            raise ValueError(f"need at least block_size+1={block_size + 1} tokens, have {len(tokens)}")
        if order not in ("random", "epoch"):
            raise ValueError(f"order must be random or epoch, got {order!r}")
        self.tokens, self.block_size, self.seed = tokens, block_size, seed
        self.order, self.doc_starts = order, doc_starts
        self.base_step = self.base_position = 0
        self._perms: dict = {}

    def resume_at(self, step: int, position: int) -> None:
        """Epoch order: step ``step`` starts at sample position ``position`` (a checkpoint's)."""
        self.base_step, self.base_position = step, position

    def position(self, step: int, global_batch: int) -> int:
        """Epoch order: the sample position where step ``step`` starts."""
        return self.base_position + (step - self.base_step) * global_batch

    def offsets(self, step: int, global_batch: int) -> np.ndarray:
        """Start offsets (int64, length ``global_batch``) of step ``step``."""
        if self.order == "epoch":
            from .epoch import epoch_windows

            pos = self.position(step, global_batch) + np.arange(global_batch, dtype=np.int64)
            return epoch_windows(self.seed, self.num_windows(), pos, self._perms) * self.block_size
        rng = np.random.default_rng([self.seed, step])
        return rng.integers(0, len(self.tokens) - self.block_size, size=global_batch, dtype=np.int64)

    def doc_ids(self, step: int, micro_step: int, rank: int, world: int, global_batch: int,
                grad_accum: int = 1) -> torch.Tensor:
        """Document ids (rows, block_size) of :meth:`batch`'s inputs."""
        from .epoch import doc_ids

        a, b = self.row_range(micro_step, rank, world, global_batch, grad_accum)
        import torch  # lazy: prepare (no torch) imports this package

        return torch.from_numpy(doc_ids(self.doc_starts, self.offsets(step, global_batch)[a:b], self.block_size))

    def eval_doc_ids(self, index: int, rank: int, world: int, global_batch: int,
                     micro_step: int = 0, grad_accum: int = 1) -> torch.Tensor:
        """Document ids of :meth:`eval_batch`'s inputs."""
        from .epoch import doc_ids

        import torch

        return torch.from_numpy(doc_ids(self.doc_starts, self._eval_offsets(index, rank, world, global_batch,
                                                                           micro_step, grad_accum), self.block_size))

    @staticmethod
    def row_range(micro_step: int, rank: int, world: int, global_batch: int,
                  grad_accum: int = 1) -> tuple[int, int]:
        """Global-batch rows ``[start, stop)`` owned by (micro_step, rank)."""
        m0, m1 = shard_range(global_batch, micro_step, grad_accum)
        r0, r1 = shard_range(m1 - m0, rank, world)
        return m0 + r0, m0 + r1

    @classmethod
    def rows(cls, micro_step: int, rank: int, world: int, global_batch: int,
             grad_accum: int = 1) -> int:
        """Number of rows (sequences) that (micro_step, rank) receives."""
        a, b = cls.row_range(micro_step, rank, world, global_batch, grad_accum)
        return b - a

    def _gather(self, offs: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        import torch

        t = self.block_size
        if isinstance(self.tokens, np.ndarray):
            buf = self.tokens[offs[:, None] + np.arange(t + 1)]  # one fancy-index read
        else:
            buf = np.empty((len(offs), t + 1), dtype=np.int64)
            for i, o in enumerate(offs):
                buf[i] = self.tokens[int(o): int(o) + t + 1]
        buf = torch.from_numpy(np.asarray(buf, dtype=np.int64).reshape(len(offs), t + 1))
        return buf[:, :-1].contiguous(), buf[:, 1:].contiguous()

    def batch(self, step: int, micro_step: int, rank: int, world: int, global_batch: int,
              grad_accum: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) int64 of shape (rows, block_size) for this rank and micro-step."""
        a, b = self.row_range(micro_step, rank, world, global_batch, grad_accum)
        return self._gather(self.offsets(step, global_batch)[a:b])

    def global_batch(self, step: int, global_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole global batch of ``step`` (all micro-steps, all ranks)."""
        return self._gather(self.offsets(step, global_batch))

    def num_eval_batches(self, global_batch: int) -> int:
        """Eval batches needed to cover every full window once."""
        return -(-self.num_windows() // global_batch)

    def num_windows(self) -> int:
        """Non-overlapping eval windows (each needs block_size+1 tokens)."""
        return (len(self.tokens) - 1) // self.block_size

    def eval_batch(self, index: int, rank: int, world: int, global_batch: int,
                   micro_step: int = 0, grad_accum: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """Eval batch ``index``: windows ``index*global_batch + i`` (wrapping)
        starting at ``window*block_size``; rows split like :meth:`batch`."""
        return self._gather(self._eval_offsets(index, rank, world, global_batch, micro_step, grad_accum))

    def _eval_offsets(self, index, rank, world, global_batch, micro_step, grad_accum) -> np.ndarray:
        a, b = self.row_range(micro_step, rank, world, global_batch, grad_accum)
        w = (index * global_batch + np.arange(a, b, dtype=np.int64)) % self.num_windows()
        return w * self.block_size


def fingerprint(tokens: Tokens, samples: int = 4, window: int = 4096) -> dict:
    """Size and a hash of a few fixed windows: cheap at any size, and it tells apart the
    per-rank files that differ (compared across ranks at start, stored in checkpoints)."""
    n = len(tokens)
    h = hashlib.sha256(str(n).encode())
    for i in range(samples):
        lo = (n - window) * i // max(1, samples - 1) if n > window else 0
        h.update(np.ascontiguousarray(np.asarray(tokens[lo:lo + window])).tobytes())
    return {"tokens": n, "sha256": h.hexdigest()[:16]}
