"""Write one rank's file: its pieces of every state kind, optimizer scalars, RNG states.

Layout of rank-XXXXX.h5 (see docs/checkpoints.md):
  /pieces                 compound table, one row per exported piece:
                          name, shape (JSON), lo, hi (element range of the parameter,
                          row-major: the global offsets), offset (into /state/<kind>)
  /state/<kind>           fp32 1-D, the pieces concatenated, for kind in STATE_KINDS
  /state/param_bf16       (bf16 runs) the same values in the custom bf16 type
  /optimizer              attrs steps (JSON {name: step}), param_groups (JSON)
  /rng/torch, /rng/numpy_keys  + attrs (numpy scalars, python state as JSON)
  /module/<name>          rank 0 only: frozen parameters and buffers, full tensors
  /                       attrs format, format_version, rank, world_size, tag,
                          scaler (JSON), counters (JSON)
"""
from __future__ import annotations

import json
import os
import random

import h5py
import numpy as np
import torch

from . import format as fmt

PIECE_DTYPE = np.dtype([("name", h5py.string_dtype()), ("shape", h5py.string_dtype()),
                        ("lo", "<i8"), ("hi", "<i8"), ("offset", "<i8")])


def model_tensors(engine) -> list[tuple[str, tuple]]:
    """(name, full shape) of every trainable parameter, in model registration order (the
    one place to adapt if an engine's parameters stop carrying their full shape)."""
    from ..parallel.tp_layout import full_shape

    shapes = {n: full_shape(p) for n, p in zip(engine.param_names, engine.params)}
    return [(n, shapes[n]) for n, _ in engine.module.named_parameters() if n in shapes]


def module_tensors(engine) -> list[tuple[str, torch.Tensor, str]]:
    """(name, tensor, 'frozen'|'buffer') for state the optimizer does not own: frozen
    parameters and persistent buffers (BatchNorm statistics and the like)."""
    trained = {id(p) for p in engine.params}
    out = []
    for name, p in engine.module.named_parameters(remove_duplicate=True):
        if id(p) not in trained:
            out.append((name, p.detach(), "frozen"))
    for name, b in engine.module.state_dict(keep_vars=True).items():
        if not isinstance(b, torch.nn.Parameter) and isinstance(b, torch.Tensor):
            out.append((name, b.detach(), "buffer"))
    return out


def _storable(t: torch.Tensor) -> np.ndarray:
    """numpy array for HDF5: 16-bit floats widen to fp32 (exact); other dtypes as they are."""
    t = t.cpu()
    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.float()
    return t.contiguous().numpy()


def _rng_state() -> dict:
    alg, keys, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    return {"torch": torch.get_rng_state().numpy(), "numpy_keys": np.asarray(keys, np.uint32),
            "numpy": json.dumps({"alg": alg, "pos": int(pos), "has_gauss": int(has_gauss),
                                 "cached_gaussian": float(cached)}),
            "python": json.dumps([version, list(internal), gauss_next])}


def _alloc_raw(group, name: str, n: int, h5type) -> int | None:
    """A contiguous dataset of n elements allocated now and never filled (we write every
    byte ourselves); its byte offset in the file, or None when empty."""
    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
    dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
    dset = h5py.h5d.create(group.id, name.encode(), h5type, h5py.h5s.create_simple((n,)), dcpl=dcpl)
    return dset.get_offset() if n else None


def _pwrite_all(fd: int, data: memoryview, pos: int) -> None:
    while len(data):
        k = os.pwrite(fd, data, pos)
        data, pos = data[k:], pos + k


def _stream(path: str, plan: list[tuple[int, list, torch.dtype | None]]) -> None:
    """Write each dataset's pieces at its file offset straight from the engine's buffers
    (os.pwrite from the tensors' memory: no concatenated copy of the shard, no HDF5
    conversion buffer). A low-precision kind is rounded piece by piece (small temporaries)."""
    fd = os.open(path, os.O_WRONLY)
    try:
        for base, pieces, cast in plan:
            pos = base
            for t in pieces:
                t = t.contiguous() if cast is None else t.to(cast).view(torch.int16)
                buf = memoryview(t.numpy()).cast("B")
                _pwrite_all(fd, buf, pos)
                pos += len(buf)
    finally:
        os.close(fd)


def rank_file_bytes(engine, lowp: str | None) -> int:
    """About how many bytes this rank's file takes (for out-of-space messages)."""
    from ..zero.state_io import STATE_KINDS, _exporting_segments

    elements = sum(s.length for s in _exporting_segments(engine))
    extra = sum(t.numel() * t.element_size() for _, t, _ in module_tensors(engine)) if engine.dims.world.rank == 0 else 0
    return elements * (4 * len(STATE_KINDS) + (2 if lowp else 0)) + extra + (1 << 16)


def _first_nonfinite(vals: torch.Tensor, pieces: list) -> str | None:
    """Name of the first parameter whose piece holds inf/nan (one pass, at save time)."""
    if bool(torch.isfinite(vals).all()):
        return None
    for name, _, lo, hi, off in pieces:
        if not bool(torch.isfinite(vals[off:off + hi - lo]).all()):
            return name
    return "?"


def write_rank_file(path: str, engine, tag: str, lowp: str | None) -> dict:
    """Write this rank's file (the caller fsyncs and hashes it). Returns what the manifest needs:
    {"pieces": [(name, shape, lo, hi, offset)], "elements": n, "module": {...}}.

    HDF5 writes the structure (piece table, attributes, RNG, module tensors) and
    allocates the state datasets contiguously; after it closes the file, the state's
    bytes go to those offsets with pwrite (_stream)."""
    state = engine.export_state(views=True)
    rank, world = engine.dims.world.rank, engine.dims.world.size
    pieces, off = [], 0
    for name, shape, lo, hi in state["pieces"]:
        pieces.append((name, [int(d) for d in shape], int(lo), int(hi), off))
        off += int(hi) - int(lo)
    module_info, plan = {}, []
    with h5py.File(path, "w", libver=fmt.LIBVER, locking=False) as f:
        f.attrs.update({"format": fmt.FORMAT, "format_version": fmt.VERSION, "rank": rank,
                        "world_size": world, "tag": tag,
                        "scaler": json.dumps(state["scaler"]),
                        "counters": json.dumps(state["counters"])})
        table = np.array([(n, json.dumps(s), lo, hi, o) for n, s, lo, hi, o in pieces], dtype=PIECE_DTYPE)
        f.create_dataset("pieces", data=table, shape=(len(pieces),), dtype=PIECE_DTYPE)
        g = f.create_group(fmt.STATE_GROUP)
        for kind, ts in state["tensors"].items():
            ts = [t.to(torch.float32) for t in ts]
            if sum(t.numel() for t in ts) != off:
                raise RuntimeError(f"export_state: {kind} has {sum(t.numel() for t in ts)} values "
                                   f"for {off} piece elements")
            if not all(bool(torch.isfinite(t).all()) for t in ts):
                # a diverged state must never replace (and then rotate away) a good one
                bad = _first_nonfinite(torch.cat(ts), pieces)
                raise FloatingPointError(f"refusing to checkpoint a diverged state: {kind} of {bad} "
                                         "holds inf/nan")
            base = _alloc_raw(g, kind, off, h5py.h5t.IEEE_F32LE)
            if base is not None:
                plan.append((base, ts, None))
            if kind == "param" and lowp:
                # Rounded like the engine's own fp32 -> bf16/fp16 working copy (round to nearest).
                base = _alloc_raw(g, lowp, off, fmt.lowp_h5type(lowp))
                if base is not None:
                    plan.append((base, ts, torch.bfloat16 if lowp == "param_bf16" else torch.float16))
        opt = f.create_group("optimizer")
        opt.attrs["steps"] = json.dumps({k: int(v) for k, v in state["steps"].items()})
        opt.attrs["param_groups"] = json.dumps(state["param_groups"])
        rng = _rng_state()
        rg = f.create_group("rng")
        rg.create_dataset("torch", data=rng["torch"])
        rg.create_dataset("numpy_keys", data=rng["numpy_keys"])
        rg.attrs["numpy"], rg.attrs["python"] = rng["numpy"], rng["python"]
        if rank == 0:
            mg = f.create_group(fmt.MODULE_GROUP)
            for name, t, role in module_tensors(engine):
                arr = _storable(t)
                d = mg.create_dataset(fmt.link_name(name), data=arr, shape=arr.shape, dtype=arr.dtype)
                d.attrs.update({"name": name, "torch_dtype": str(t.dtype).replace("torch.", ""), "role": role})
                module_info[name] = {"shape": list(arr.shape), "dtype": arr.dtype.str,
                                     "torch_dtype": str(t.dtype).replace("torch.", ""),
                                     "role": role, "link": fmt.link_name(name)}
        summary = {"counters": dict(state["counters"]), "scaler": dict(state["scaler"])}
    _stream(path, plan)
    del state, plan
    return dict(summary, pieces=pieces, elements=off, module=module_info)
