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

import numpy as np
import torch

from . import hdf5, naming
from .rankfile_h5 import (ALIGN as _ALIGN, CHUNK as _CHUNK, H5_ALIGNMENT, IN_FLIGHT as _IN_FLIGHT, Writer,
                       aligned as _aligned, alloc_raw, check_room, module_entry, open_direct, write_structure)


def model_tensors(view) -> list[tuple[str, tuple]]:
    """(name, full shape) of every trainable parameter, in model registration order (the
    one place to adapt if an engine's parameters stop carrying their full shape)."""
    from ..parallel.tp_layout import full_shape

    shapes = {n: full_shape(p) for n, p in zip(view.param_names, view.params)}
    return [(n, shapes[n]) for n, _ in view.module.named_parameters() if n in shapes]


def module_tensors(view) -> list[tuple[str, torch.Tensor, str]]:
    """(name, tensor, 'frozen'|'buffer') for state the optimizer does not own: frozen
    parameters and persistent buffers (BatchNorm statistics and the like)."""
    trained = {id(p) for p in view.params}
    out = []
    for name, p in view.module.named_parameters(remove_duplicate=True):
        if id(p) not in trained:
            out.append((name, p.detach(), "frozen"))
    for name, b in view.module.state_dict(keep_vars=True).items():
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


def _stream(path: str, plan: list[tuple], names: list[str]) -> tuple[str, int]:
    """Write each dataset's pieces at its file offset from the engine's buffers and fsync;
    returns the file's (digest, size), as checksums.digest_file computes it, checksummed
    from memory as the bytes are written (the bytes HDF5 wrote are read back, in order).

    plan: (file offset, kind, pieces, bytes, stored dtype) per dataset. Every fp32 value
    is checked for inf/nan on its way out (the error names the tensor; the caller then
    removes the file). Bytes move in _CHUNK units, each copied once: with O_DIRECT from
    the pieces into one of a few reused aligned buffers (the copy the kernel would
    otherwise make into fresh page-cache pages), else with pwrite straight from views
    of the pieces (low-precision kinds and tensors off the host are staged through the
    reused buffers: copy_ rounds to nearest, like .to()). No concatenation of the shard,
    no HDF5 conversion buffer, no temporary the size of a tensor."""
    plan = sorted(plan, key=lambda p: p[0])
    finite = np.empty(_CHUNK // 4, dtype=bool)
    ring: list[list] = []   # [aligned buffer, future of its last write], last = in use

    def slot() -> np.ndarray:
        if not ring:
            ring.extend([_aligned(_CHUNK), None] for _ in range(_IN_FLIGHT + 1))
        ring.append(ring.pop(0))
        if ring[-1][1] is not None:
            ring[-1][1].result()   # its previous bytes are written
        return ring[-1][0]

    def check(a: np.ndarray, kind: str, j: int) -> None:
        ok = finite[:a.size]
        np.isfinite(a, out=ok)
        if not ok.all():
            # a diverged state must never replace (and then rotate away) a good one
            raise FloatingPointError(f"refusing to checkpoint a diverged state: {kind} of "
                                     f"{names[j]} holds inf/nan")

    fd = os.open(path, os.O_RDWR)
    w = Writer(path, fd, open_direct(path))
    try:
        size = os.fstat(fd).st_size   # HDF5 allocated every dataset: the file's final size
        if plan and plan[-1][0] + plan[-1][3] > size:
            raise RuntimeError(f"{path}: dataset at {plan[-1][0]} ends past the end of the file")
        pos = 0
        for base, kind, pieces, nbytes, store in plan:
            w.gap(pos, base)
            pos = base
            elem = torch.empty(0, dtype=store).element_size()
            checked = kind if store == torch.float32 else None
            if w.dfd is not None and base % _ALIGN == 0:
                # pack the pieces into aligned buffers, each written with O_DIRECT
                buf, fill = slot(), 0
                for j, t in enumerate(pieces):
                    t, i = t.reshape(-1), 0
                    while i < t.numel():
                        k = min(t.numel() - i, (_CHUNK - fill) // elem)
                        dst = torch.from_numpy(buf[fill:fill + k * elem]).view(store)
                        dst.copy_(t[i:i + k])
                        if checked:
                            check(dst.numpy(), checked, j)
                        fill, i = fill + k * elem, i + k
                        if fill == _CHUNK:
                            ring[-1][1] = w.put(buf, pos, True)
                            buf, fill, pos = slot(), 0, pos + _CHUNK
                if fill:
                    ring[-1][1] = w.put(buf[:fill], pos, True)
                    pos += fill
            else:
                step = _CHUNK // elem
                for j, t in enumerate(pieces):
                    t = t.reshape(-1)
                    for lo in range(0, t.numel(), step):
                        c = t[lo:lo + step]
                        staged = c.dtype != store or c.device.type != "cpu"
                        if staged:
                            buf = slot()
                            c = torch.from_numpy(buf[:c.numel() * elem]).view(store).copy_(c)
                        if checked:
                            check(c.numpy(), checked, j)
                        a = c.view(torch.uint8).numpy()
                        fut = w.put(a, pos, False)
                        if staged:
                            ring[-1][1] = fut
                        pos += a.size
            if pos != base + nbytes:
                raise RuntimeError(f"{path}: wrote {pos - base} bytes of {kind}, {nbytes} allocated")
        digest = w.seal(pos, size)
    finally:
        w.close()
        os.close(fd)
    return digest, size


def rank_file_bytes(view, lowp: str | None) -> int:
    """About how many bytes this rank's file takes (for out-of-space messages)."""
    elements = view.exported_elements()
    extra = sum(t.numel() * t.element_size() for _, t, _ in module_tensors(view)) if view.dims.world.rank == 0 else 0
    return elements * (4 * len(view.state_kinds) + (2 if lowp else 0)) + extra + (1 << 16)


def header_of(view, tag: str, state: dict) -> dict:
    """rankfile_h5.write_structure's header for export_state's `state`, taken now (the RNG
    states too): the pieces with their offsets into the state vectors."""
    pieces, off = [], 0
    for name, shape, lo, hi in state["pieces"]:
        pieces.append((name, [int(d) for d in shape], int(lo), int(hi), off))
        off += int(hi) - int(lo)
    attrs = {"format": naming.FORMAT, "format_version": naming.VERSION, "rank": view.dims.world.rank,
             "world_size": view.dims.world.size, "tag": tag,
             "scaler": json.dumps(state["scaler"]), "counters": json.dumps(state["counters"])}
    return {"attrs": attrs, "pieces": pieces, "elements": off, "rng": _rng_state(),
            "steps": json.dumps({k: int(v) for k, v in state["steps"].items()}),
            "param_groups": json.dumps(state["param_groups"]),
            "summary": {"counters": dict(state["counters"]), "scaler": dict(state["scaler"])}}


def storable_module(view) -> list[tuple[str, np.ndarray, str, str]]:
    """rankfile_h5.write_structure's module list: rank 0's frozen parameters and buffers."""
    if view.dims.world.rank != 0:
        return []
    return [(name, _storable(t), str(t.dtype).replace("torch.", ""), role) for name, t, role in module_tensors(view)]


def write_rank_file(path: str, view, tag: str, lowp: str | None) -> dict:
    """Write and fsync this rank's file. Returns what the manifest needs:
    {"pieces": [(name, shape, lo, hi, offset)], "elements": n, "module": {...},
    "digest": checksums.digest_file's value, "size": bytes}.

    HDF5 writes the structure (piece table, attributes, RNG, module tensors) and
    allocates the state datasets contiguously; after it closes the file, the state's
    bytes go to those offsets with pwrite (_stream), checksummed from memory as they go."""
    import h5py

    state = view.export_state(views=True)
    header = header_of(view, tag, state)
    off, module, plan = header["elements"], storable_module(view), []
    check_room(path, rank_file_bytes(view, lowp))
    with h5py.File(path, "w", libver=hdf5.LIBVER, locking=False, **H5_ALIGNMENT) as f:
        write_structure(f, header, module)
        g = f.create_group(naming.STATE_GROUP)
        for kind, ts in state["tensors"].items():
            ts = [t.to(torch.float32) for t in ts]
            if sum(t.numel() for t in ts) != off:
                raise RuntimeError(f"export_state: {kind} has {sum(t.numel() for t in ts)} values "
                                   f"for {off} piece elements")
            # inf/nan is refused while streaming (_stream checks every fp32 chunk)
            base = alloc_raw(g, kind, off, h5py.h5t.IEEE_F32LE)
            if base is not None:
                plan.append((base, kind, ts, 4 * off, torch.float32))
            if kind == "param" and lowp:
                # Rounded like the engine's own fp32 -> bf16/fp16 working copy (round to nearest).
                base = alloc_raw(g, lowp, off, hdf5.lowp_h5type(lowp))
                if base is not None:
                    plan.append((base, lowp, ts, 2 * off, torch.bfloat16 if lowp == "param_bf16" else torch.float16))
    digest, size = _stream(path, plan, [p[0] for p in header["pieces"]])
    del state, plan
    return dict(header["summary"], pieces=header["pieces"], elements=off, digest=digest, size=size,
                module={n: module_entry(n, arr.shape, arr.dtype.str, td, role) for n, arr, td, role in module})
