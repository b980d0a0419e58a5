"""Hugging Face safetensors checkpoints in (the trainer's `init_from`), one tensor at a time.

    src = HFCheckpoint("path/to/llama", "llama")   # reads headers only
    src.keys()                 # our parameter names (models/hf_names.py)
    src.shape_of(name)         # our shape, from the header
    src[name]                  # one tensor, read now (safe_open), in our layout
    load_hf(engine, "path/to/llama", "llama")      # collective: into an engine, any stage/tp

A directory holds model.safetensors, or shards listed by model.safetensors.index.json
(its weight_map). Nothing is read until a tensor is asked for, and then only that
tensor (safetensors' safe_open maps the file; get_tensor copies one tensor out), so
engine.load_full_state_dict (zero/load_full.py) streaming from this source holds one
full tensor at a time on the reading rank, beside its own share of the model.
"""
from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping

import torch

from . import hf_names

INDEX, SINGLE = "model.safetensors.index.json", "model.safetensors"


def _header(path: str) -> dict:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


class HFCheckpoint(Mapping):
    """Our names -> tensors of a local HF safetensors checkpoint (see the module doc)."""

    def __init__(self, directory: str, family: str):
        self.dir, self.family = directory, family
        index, single = os.path.join(directory, INDEX), os.path.join(directory, SINGLE)
        if os.path.exists(index):
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        elif os.path.exists(single):
            files = [SINGLE]
        else:
            other = [n for n in ("pytorch_model.bin", "pytorch_model.bin.index.json")
                     if os.path.exists(os.path.join(directory, n))]
            raise FileNotFoundError(f"{directory}: no {SINGLE} or {INDEX}" + (
                f" ({other[0]} is pickled torch, not read: re-save it with safetensors)" if other else ""))
        self._where: dict[str, tuple[str, str, list[int]]] = {}
        self.skipped: list[str] = []
        for name in files:
            path = os.path.join(directory, name)
            for hf, h in _header(path).items():
                if hf == "__metadata__":
                    continue
                ours = hf_names.our_name(family, hf)
                if ours is None:
                    self.skipped.append(hf)
                    continue
                shape = list(h["shape"])
                if hf_names.transposed(family, ours):
                    shape = shape[::-1]
                self._where[ours] = (path, hf, shape)

    def __getitem__(self, ours: str) -> torch.Tensor:
        from safetensors import safe_open

        path, hf, _ = self._where[ours]
        with safe_open(path, framework="pt") as f:
            t = f.get_tensor(hf)
        return t.t().contiguous() if hf_names.transposed(self.family, ours) else t

    def shape_of(self, ours: str) -> tuple[int, ...]:
        return tuple(self._where[ours][2])

    def __iter__(self):
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, ours) -> bool:
        return ours in self._where


def load_hf(engine, directory: str, family: str):
    """Collective: the weights of a HF checkpoint into `engine` (strict: every parameter
    from the file, no tensor left over). Each rank opens the directory's headers; each
    data-parallel group's rank 0 reads the tensors (one at a time) and streams them to
    its group. Returns zero/load_full.LoadResult."""
    src, error = None, None
    try:
        src = HFCheckpoint(directory, family)
    except (OSError, ValueError, KeyError) as e:
        error = f"{type(e).__name__}: {e}"
    # every rank raises together, before any collective of the load (ranks that cannot
    # see the directory would otherwise leave their peers waiting)
    errors = [x for x in engine.dims.world.allgather_object(error) if x]
    if errors:
        raise ValueError(f"init_from {directory}: {errors[0]}")
    try:
        return engine.load_full_state_dict(src, strict=True)
    except ValueError as e:
        raise ValueError(f"init_from {directory}: {e}") from None
