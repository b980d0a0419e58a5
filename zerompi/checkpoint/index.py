"""index.h5: Virtual Datasets that present every tensor at its full shape.

/param/<name>, /exp_avg/<name>, /exp_avg_sq/<name>   fp32, full shape
/param_bf16/<name> (or /param_fp16)                  bf16 runs: the custom bf16 type
/module/<name>                                       frozen parameters and buffers
Each piece of a rank file maps onto at most 2*ndim-1 hyperslabs of the full-shape
dataset (hdf5.flat_blocks). Source files are named relative to index.h5, so the
directory can be moved or renamed as a whole.

A VDS whose source file is missing reads as its fill value without any error; the fill
value here is NaN, so a damaged checkpoint at least does not look like zeros, but
readers must verify first (zerompi.inspect --verify, zerompi.checkpoint.verify_checkpoint).
"""
from __future__ import annotations

import json
import os

import h5py
import numpy as np

from ..runtime.fileio import atomic_write
from . import checksums, hdf5, manifest_json, naming


def _space(shape: list[int]):
    return h5py.h5s.create(h5py.h5s.SCALAR) if not shape else h5py.h5s.create_simple(tuple(shape))


def _dcpl(h5type_fill: np.ndarray | None):
    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    if h5type_fill is not None:
        dcpl.set_fill_value(h5type_fill)
    return dcpl


def _map_pieces(dcpl, shape: list[int], pieces: list[list[int]], files: dict[int, tuple[str, int]],
                src_dataset: bytes) -> None:
    """pieces: [rank, lo, hi, offset]; files: rank -> (file name, elements in its state)."""
    for rank, lo, hi, off in pieces:
        fname, total = files[rank]
        if not shape:  # 0-d tensor: the whole (scalar) space maps to one source element
            vs = _space(shape)
            vs.select_all()
            ss = h5py.h5s.create_simple((total,))
            ss.select_hyperslab((off,), (1,))
            dcpl.set_virtual(vs, fname.encode(), src_dataset, ss)
            continue
        pos = off
        for start, count in hdf5.flat_blocks(tuple(shape), lo, hi):
            n = int(np.prod(count))
            vs = _space(shape)
            vs.select_hyperslab(start, count)
            ss = h5py.h5s.create_simple((total,))
            ss.select_hyperslab((pos,), (n,))
            dcpl.set_virtual(vs, fname.encode(), src_dataset, ss)
            pos += n


def write_index(path: str, manifest: dict) -> None:
    files = {info["rank"]: (name, info["elements"]) for name, info in manifest["files"].items()}
    kinds = list(manifest["kinds"]) + ([manifest["lowp_kind"]] if manifest.get("lowp_kind") else [])
    with h5py.File(path, "w", libver=hdf5.LIBVER, locking=False) as f:
        f.attrs.update({"format": naming.FORMAT, "format_version": naming.VERSION, "tag": manifest["tag"],
                        "global_steps": manifest["counters"]["global_steps"],
                        "world_size": manifest["world_size"], "stage": manifest["stage"],
                        "precision": manifest["precision"],
                        # The full manifest (config, files and their sha256, client_state)
                        # for users who only have HDF5 tools; manifest.json is the same.
                        "manifest": manifest_json.canonical(manifest).decode()})
        for kind in kinds:
            g = f.create_group(kind)
            lowp = kind == manifest.get("lowp_kind")
            h5type = hdf5.lowp_h5type(kind) if lowp else h5py.h5t.IEEE_F32LE
            src = f"/{naming.STATE_GROUP}/{kind}".encode()
            for name, t in manifest["tensors"].items():
                dcpl = _dcpl(np.array(np.nan, np.float32))
                _map_pieces(dcpl, t["shape"], t["pieces"], files, src)
                ds = h5py.h5d.create(g.id, t["link"].encode(), h5type, _space(t["shape"]), dcpl=dcpl)
                h5py.Dataset(ds).attrs["name"] = name
        if manifest["module_tensors"]:
            g = f.create_group(naming.MODULE_GROUP)
            src_file = naming.rank_file(0)
            with h5py.File(os.path.join(os.path.dirname(path), src_file), "r", locking=False) as r0:
                for name, t in manifest["module_tensors"].items():
                    src = f"/{naming.MODULE_GROUP}/{t['link']}"
                    dcpl = _dcpl(None)
                    vs, ss = _space(t["shape"]), _space(t["shape"])
                    vs.select_all()
                    ss.select_all()
                    dcpl.set_virtual(vs, src_file.encode(), src.encode(), ss)
                    ds = h5py.h5d.create(g.id, t["link"].encode(), r0[src].id.get_type(),
                                         _space(t["shape"]), dcpl=dcpl)
                    h5py.Dataset(ds).attrs["name"] = name


def write_metadata(tmp: str, manifest: dict) -> None:
    """index.h5 and manifest.json of a checkpoint whose rank files are all in `tmp`,
    fsynced (the manifest records the index's size and checksum, so it comes last)."""
    index_path = os.path.join(tmp, naming.INDEX)
    write_index(index_path, manifest)
    digest, size = checksums.fsync_and_hash(index_path)
    manifest["index"] = {"file": naming.INDEX, "size": size, "digest": digest}
    atomic_write(os.path.join(tmp, naming.MANIFEST), json.dumps(manifest_json.seal(manifest), indent=1))
