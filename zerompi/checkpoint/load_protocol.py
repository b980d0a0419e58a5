"""Collective, verified load at any world size and stage (all ranks call it together).

1. rank 0 finds the checkpoint (tag or DIR/latest) and broadcasts manifest.json;
2. every rank checks all file sizes and hashes its share of the files (file i on rank
   i % M), checks piece coverage and that names/shapes match the model; the ranks
   agree on their findings (errors.raise_agreed), so either all continue or all raise
   CheckpointError, naming the rank and the file;
3. every rank reads only the element ranges it owns now (state_io.needed_pieces via
   fetch), from the rank files that hold them, straight into the engine's host buffers
   (import_state says where), then the working parameters are all-gathered.

RNG: at the saved world size each rank restores its own torch/numpy/python RNG states.
At another world size there is no meaningful mapping of old ranks to new ones, so every
rank reseeds deterministically with seed = config.seed + 1000003 * (global_steps + 1)
(+ rank, as at start-up): a resumed job is still reproducible run to run.
"""
from __future__ import annotations

import ctypes
import os
import random

import numpy as np
import torch

from .. import runtime
from ..optim import schedulers
from . import directory as dirs
from . import manifest_json, naming
from .errors import CheckpointError, raise_agreed
from . import verify as ver
from .reader import PieceReader
from .rankfile_engine import model_tensors, module_tensors

_CONTEXT = "cannot load checkpoint"


def _locate(comm, directory, tag) -> tuple[str | None, bytes | None]:
    """(checkpoint directory, manifest.json bytes), found by rank 0 and broadcast;
    (None, None) when DIR holds no checkpoint."""
    found, err = (None, None), None
    if comm.rank == 0:
        try:
            ckpt = dirs.resolve(directory, tag)
            if ckpt is not None:
                path = os.path.join(ckpt, naming.MANIFEST)
                try:
                    with open(path, "rb") as f:
                        found = (ckpt, f.read())
                except FileNotFoundError:
                    raise CheckpointError(f"{path}: missing (not a complete zerompi checkpoint)") from None
        except (CheckpointError, ValueError, OSError) as e:
            err = str(e)
    raise_agreed(comm, err, _CONTEXT)
    return comm.bcast_object(found)


def _check(view, ckpt: str, text: bytes, verify: bool) -> tuple[dict | None, list[str]]:
    comm = view.dims.world
    try:
        manifest = manifest_json.unseal(text, os.path.join(ckpt, naming.MANIFEST))
        manifest["_path"] = ckpt
    except CheckpointError as e:
        return None, [str(e)]
    errors = ver.check_files(ckpt, manifest, (comm.rank, comm.size) if verify else None)
    errors += ver.check_coverage(manifest)
    missing = [k for k in view.state_kinds if k not in manifest["kinds"]]
    if missing:
        errors.append(f"{ckpt}: no {', '.join(missing)} state in the checkpoint")
    errors += ver.check_model(manifest, model_tensors(view))
    saved = {n: tuple(t["shape"]) for n, t in manifest.get("module_tensors", {}).items()}
    errors += ver.check_model({"tensors": {n: {"shape": s} for n, s in saved.items()}, "_path": ckpt},
                              [(n, tuple(t.shape)) for n, t, _ in module_tensors(view)],
                              what="frozen parameter or buffer")
    return manifest, errors


def _host_array(t: torch.Tensor) -> np.ndarray:
    """numpy view of a contiguous host fp32 tensor, built from its address: t.numpy()
    refuses tensors that require grad and marks the storage non-resizable for good."""
    n = t.numel()
    if n == 0:
        return np.empty(0, np.float32)
    return np.ctypeslib.as_array((ctypes.c_float * n).from_address(t.data_ptr()))


def _restore_rng(rng: dict) -> None:
    torch.set_rng_state(torch.from_numpy(np.array(rng["torch"], dtype=np.uint8)))
    n = rng["numpy"]
    np.random.set_state((n["alg"], np.array(rng["numpy_keys"], dtype=np.uint32), n["pos"],
                         n["has_gauss"], n["cached_gaussian"]))
    version, internal, gauss_next = rng["python"]
    random.setstate((version, tuple(internal), gauss_next))


def load(view, directory, tag: str | None = None, verify: bool = True) -> dict | None:
    """Load into the engine of `view` (engine.checkpoint_view()); returns the saved
    client_state (None when DIR has no checkpoint). verify=False skips the sha256 pass (sizes and structure still checked)."""
    comm = view.dims.world
    ckpt, text = _locate(comm, directory, tag)
    if ckpt is None:
        return None
    manifest, errors = _check(view, ckpt, text, verify)
    # The checksum shares finish at different times (rank 0 also hashes index.h5): wait
    # sleeping, since ranks spinning in the agreement's allgather would take the cores
    # of those still hashing when ranks outnumber cores.
    comm.barrier(poll=True)
    raise_agreed(comm, errors, _CONTEXT)

    same_world = (manifest["world_size"] == comm.size
                  and manifest.get("tensor_parallel_size", 1) == view.dims.tp_size)
    reader = PieceReader(ckpt, manifest)
    try:
        meta = own = None
        errors = []
        try:
            meta = reader.rank_state(0)
            own = reader.rank_state(comm.rank) if same_world else None
            extra = {n: reader.module_tensor(n) for n in manifest.get("module_tensors", {})}
        except CheckpointError as e:
            errors.append(str(e))
        raise_agreed(comm, errors, _CONTEXT)

        def fetch(kind: str, name: str, lo: int, hi: int, out: torch.Tensor | None = None) -> torch.Tensor:
            if out is None:
                return torch.from_numpy(reader.read(kind, name, lo, hi))
            reader.read(kind, name, lo, hi, out=_host_array(out))  # HDF5 reads into the engine's buffer
            return out

        view.import_state(fetch, meta["steps"], meta["param_groups"], meta["scaler"], meta["counters"])
        schedulers.load_state(view, manifest.get("lr_scheduler"))
        with torch.no_grad():
            for name, t, _ in module_tensors(view):
                t.copy_(torch.from_numpy(np.asarray(extra[name])).reshape(t.shape))
    finally:
        reader.close()
    if same_world:
        _restore_rng(own["rng"])
    else:
        seed = int(view.config.seed) + 1000003 * (int(meta["counters"]["global_steps"]) + 1)
        runtime.seed_everything(seed, view.rank)  # the dp rank, as at start-up
    return manifest["client_state"]
