"""Read element ranges of saved tensors straight from the rank files (numpy, no torch).

The manifest records, for every tensor, which rank file holds which element range and
where it starts in that file's /state/<kind> vector. A reader asks for (kind, name, lo,
hi) and gets exactly those values, reading only the overlapping slices of the files
that hold them: never a whole foreign file, and never through index.h5 (whose VDS would
turn a missing file into silent fill values).
"""
from __future__ import annotations

import bisect
import json
import os

import h5py
import numpy as np

from . import naming
from .errors import CheckpointError


class PieceReader:
    def __init__(self, ckpt: str, manifest: dict):
        self.ckpt, self.manifest = ckpt, manifest
        self._files: dict[int, h5py.File] = {}
        self._names = {info["rank"]: name for name, info in manifest["files"].items()}
        # Per tensor: pieces sorted by lo, plus the lo's for bisection.
        self._pieces = {n: sorted(t["pieces"], key=lambda p: p[1]) for n, t in manifest["tensors"].items()}
        self._los = {n: [p[1] for p in ps] for n, ps in self._pieces.items()}

    def file(self, rank: int) -> h5py.File:
        f = self._files.get(rank)
        if f is None:
            path = os.path.join(self.ckpt, self._names[rank])
            try:
                f = self._files[rank] = h5py.File(path, "r", locking=False)
            except OSError as e:
                raise CheckpointError(f"{path}: cannot open ({e})") from None
        return f

    def read(self, kind: str, name: str, lo: int, hi: int, out: np.ndarray | None = None) -> np.ndarray:
        """Values [lo, hi) of tensor `name` (flattened, row-major) for `kind`."""
        if name not in self._pieces:
            raise CheckpointError(f"{self.ckpt}: tensor {name} is not in the checkpoint")
        if out is None:
            out = np.empty(hi - lo, dtype=np.float32)
        pieces, los = self._pieces[name], self._los[name]
        i = max(0, bisect.bisect_right(los, lo) - 1)
        pos = lo
        while pos < hi:
            if i >= len(pieces) or pieces[i][1] > pos or pieces[i][2] <= pos:
                raise CheckpointError(f"{self.ckpt}: tensor {name}: element {pos} is in no piece")
            r, plo, phi, off = pieces[i]
            end = min(hi, phi)
            path = self._names[r]
            try:
                dset = self.file(r)[f"{naming.STATE_GROUP}/{kind}"]
                a = off + pos - plo
                dset.read_direct(out, np.s_[a:a + end - pos], np.s_[pos - lo:end - lo])
            except KeyError:
                raise CheckpointError(f"{os.path.join(self.ckpt, path)}: no /{naming.STATE_GROUP}/{kind} "
                                      f"(tensor {name})") from None
            except (OSError, ValueError, TypeError) as e:
                raise CheckpointError(f"{os.path.join(self.ckpt, path)}: reading {kind} of {name} failed ({e})") from None
            pos, i = end, i + 1
        return out

    def read_full(self, kind: str, name: str) -> np.ndarray:
        t = self.manifest["tensors"][name]
        numel = int(np.prod(t["shape"])) if t["shape"] else 1
        return self.read(kind, name, 0, numel).reshape(t["shape"])

    def module_tensor(self, name: str) -> np.ndarray:
        t = self.manifest["module_tensors"][name]
        try:
            return self.file(0)[f"{naming.MODULE_GROUP}/{t['link']}"][()]
        except KeyError:
            raise CheckpointError(f"{os.path.join(self.ckpt, self._names[0])}: no module tensor {name}") from None

    def rank_state(self, rank: int) -> dict:
        """Optimizer steps, param groups, scaler, counters and RNG of one rank file."""
        f = self.file(rank)
        try:
            opt, rng = f["optimizer"], f["rng"]
            return {
                "steps": json.loads(opt.attrs["steps"]),
                "param_groups": json.loads(opt.attrs["param_groups"]),
                "scaler": json.loads(f.attrs["scaler"]),
                "counters": json.loads(f.attrs["counters"]),
                "rng": {"torch": rng["torch"][()], "numpy_keys": rng["numpy_keys"][()],
                        "numpy": json.loads(rng.attrs["numpy"]), "python": json.loads(rng.attrs["python"])},
            }
        except (KeyError, ValueError) as e:
            raise CheckpointError(f"{os.path.join(self.ckpt, self._names[rank])}: "
                                  f"missing or damaged metadata ({e})") from None

    def close(self) -> None:
        for f in self._files.values():
            try:
                f.close()
            except Exception:
                pass
        self._files.clear()

    def __enter__(self) -> "PieceReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
