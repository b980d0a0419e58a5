"""Checks that make a damaged checkpoint fail loudly instead of loading zeros.

- the manifest parses and its own checksum matches (manifest_json.unseal);
- every listed file exists with the recorded size and checksum (CRC-32 per 64 MiB block;
  sha256 in older checkpoints);
- the pieces of every tensor tile [0, numel) exactly (no gap, no overlap);
- the tensor names and shapes are those of the model being loaded.
Each function returns a list of messages naming the file (and the tensors it holds), so
MPI ranks can exchange them and raise together.
"""
from __future__ import annotations

import os

import numpy as np

from . import checksums, manifest_json, naming
from .errors import CheckpointError


def read_manifest(ckpt: str) -> dict:
    path = os.path.join(ckpt, naming.MANIFEST)
    try:
        with open(path, "rb") as f:
            text = f.read()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing (not a complete zerompi checkpoint)") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e})") from None
    m = manifest_json.unseal(text, path)
    for key in ("tag", "world_size", "kinds", "tensors", "files", "index", "counters", "created_ns"):
        if key not in m:
            raise CheckpointError(f"{path}: no {key!r} entry")
    return m


def tensors_in(manifest: dict, fname: str, limit: int = 4) -> str:
    """Names of the tensors whose pieces live in `fname`, for error messages."""
    info = manifest["files"].get(fname)
    if info is None:
        return ""
    r = info["rank"]
    names = [n for n, t in manifest["tensors"].items() if any(p[0] == r for p in t["pieces"])]
    if r == 0:
        names += list(manifest.get("module_tensors", {}))
    if not names:
        return ""
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return f" (holds {', '.join(names[:limit])}{more})"


def file_list(manifest: dict) -> list[tuple[str, dict]]:
    """(name, {size, sha256, ...}) of every file in the checkpoint, index.h5 last."""
    return sorted(manifest["files"].items()) + [(naming.INDEX, manifest["index"])]


def check_files(ckpt: str, manifest: dict, hash_share: tuple[int, int] | None = (0, 1),
                threads: int | None = None) -> list[str]:
    """Existence and size of every file; sha256 of the files in this caller's share
    (file i when i % size == rank; None = no hashing). Sizes are checked by every caller
    because they are free, hashes once per file across the ranks."""
    errors = []
    for i, (name, info) in enumerate(file_list(manifest)):
        path = os.path.join(ckpt, name)
        what = tensors_in(manifest, name)
        try:
            size = os.stat(path).st_size
        except FileNotFoundError:
            errors.append(f"{path}: missing{what}")
            continue
        except OSError as e:
            errors.append(f"{path}: cannot stat ({e})")
            continue
        if size != info["size"]:
            errors.append(f"{path}: {size} bytes, the manifest says {info['size']} (truncated or replaced){what}")
            continue
        if hash_share is not None and i % hash_share[1] == hash_share[0]:
            try:
                ok, algo = checksums.file_matches(path, info, threads or checksums.hash_threads(hash_share[1]))
            except OSError as e:
                errors.append(f"{path}: cannot read ({e})")
                continue
            if not ok:
                errors.append(f"{path}: checksum ({algo}) mismatch, the file is corrupt{what}")
    return errors


def check_coverage(manifest: dict) -> list[str]:
    errors = []
    ranks = {info["rank"] for info in manifest["files"].values()}
    for name, t in manifest["tensors"].items():
        numel = int(np.prod(t["shape"])) if t["shape"] else 1
        pos = 0
        for r, lo, hi, _ in sorted(t["pieces"], key=lambda p: p[1]):
            if r not in ranks:
                errors.append(f"tensor {name}: piece [{lo}, {hi}) in {naming.rank_file(r)}, which is not listed")
            if lo != pos:
                errors.append(f"tensor {name}: elements [{min(pos, lo)}, {max(pos, lo)}) "
                              f"{'missing' if lo > pos else 'stored twice'}")
            pos = max(pos, hi)
        if pos != numel:
            errors.append(f"tensor {name}: elements [{pos}, {numel}) missing")
    return errors


def _names(names: list[str], limit: int = 6) -> str:
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def check_model(manifest: dict, expected: list[tuple[str, tuple]], what: str = "parameter") -> list[str]:
    """Tensor names/shapes of the checkpoint against the model's (name, shape) list."""
    saved = {n: tuple(t["shape"]) for n, t in manifest["tensors"].items()}
    mine = dict((n, tuple(s)) for n, s in expected)
    where = manifest.get("_path", "checkpoint")
    errors = [f"{where}: {what} {n} has shape {list(saved[n])} in the checkpoint, {list(s)} in the model"
              for n, s in mine.items() if n in saved and saved[n] != s]
    missing = [n for n in mine if n not in saved]
    extra = [n for n in saved if n not in mine]
    hint = " (a checkpoint of another model?)" if missing and extra else ""
    if missing:
        errors.append(f"{where}: {what}s of the model not in the checkpoint: {_names(missing)}{hint}")
    if extra:
        errors.append(f"{where}: {what}s in the checkpoint not in the model: {_names(extra)}{hint}")
    return errors


def check_structure(ckpt: str, manifest: dict) -> list[str]:
    """Open every rank file and check its datasets against the manifest (sizes match
    the recorded pieces). Catches a file that verifies but was written by a different
    save, e.g. copied in by hand with a forged manifest."""
    import h5py

    errors = []
    for name, info in sorted(manifest["files"].items()):
        path = os.path.join(ckpt, name)
        try:
            with h5py.File(path, "r", locking=False) as f:
                for kind in manifest["kinds"]:
                    n = f[f"{naming.STATE_GROUP}/{kind}"].shape[0]
                    if n != info["elements"]:
                        errors.append(f"{path}: /{naming.STATE_GROUP}/{kind} has {n} values, expected {info['elements']}")
        except (OSError, KeyError) as e:
            errors.append(f"{path}: unreadable HDF5 ({e})")
    return errors


def verify_checkpoint(ckpt: str) -> dict:
    """Full single-process verification (inspect --verify); returns the manifest or
    raises CheckpointError listing every problem."""
    manifest = read_manifest(ckpt)
    errors = check_files(ckpt, manifest) + check_coverage(manifest)
    if not errors:
        errors = check_structure(ckpt, manifest)
    if errors:
        raise CheckpointError(f"checkpoint {ckpt} failed verification:\n  " + "\n  ".join(errors))
    return manifest
