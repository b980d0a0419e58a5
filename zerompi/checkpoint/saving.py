"""Collective, atomic save (all ranks call it together).

1. every rank validates its arguments; the ranks agree on errors (no rank proceeds alone);
2. rank 0 creates DIR/.tmp-TAG-<random> and broadcasts its name; at the first save of a
   multi-node job, every node must see it (shared.py: else one message, nothing left);
3. each rank writes rank-XXXXX.h5, checksumming its bytes from memory as they are
   written (writer._stream: CRC-32 per 64 MiB block, as format.digest_file computes),
   and fsyncs it;
4. the ranks agree on errors, then exchange piece tables (this is the barrier: every
   file is durable);
5. rank 0 writes index.h5 and manifest.json (fsynced), fsyncs the directory, renames it
   to DIR/TAG, rewrites DIR/latest (zerompi.runtime.fileio.atomic_write), cleans up crashed
   saves and applies keep_last; the ranks agree on its outcome, so all of them return
   or raise together.

Every error agreement is format.raise_agreed (zerompi.runtime.agree underneath): the
message names the rank and the file; bad arguments keep TypeError/ValueError, anything
else is CheckpointError.
"""
from __future__ import annotations

import errno
import json
import os
import platform
import shutil
import tempfile
import time
import warnings

import h5py
import torch

from .. import runtime
from ..runtime.fileio import atomic_write
from . import directory as dirs
from . import format as fmt
from .index import write_index
from .shared import check_once as check_shared_once
from .verify import check_coverage
from .writer import model_tensors, rank_file_bytes, write_rank_file

_PRECISION_DTYPE = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def _build_manifest(engine, tag: str, infos: list[dict], client_json: str, lowp: str | None) -> dict:
    from ..version import __version__
    from ..config import to_dict

    tensors = {name: {"shape": list(shape), "link": fmt.link_name(name), "pieces": []}
               for name, shape in model_tensors(engine)}
    for r, info in enumerate(infos):
        for name, shape, lo, hi, off in info["pieces"]:
            tensors[name]["pieces"].append([r, lo, hi, off])
    for t in tensors.values():
        t["pieces"].sort(key=lambda p: p[1])
    # Tied parameters are stored once under their first name; record the other names.
    first, aliases = {}, {}
    for name, p in engine.module.named_parameters(remove_duplicate=False):
        if id(p) in first and first[id(p)] != name:
            aliases[name] = first[id(p)]
        first.setdefault(id(p), name)
    files = {fmt.rank_file(r): {"rank": r, "size": i["size"], "digest": i["digest"],
                                "elements": i["elements"]} for r, i in enumerate(infos)}
    cfg = engine.config
    return {
        "format": fmt.FORMAT, "format_version": fmt.VERSION, "tag": tag,
        "created_ns": time.time_ns(), "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "zerompi_version": __version__, "torch_version": torch.__version__,
        "h5py_version": h5py.version.version, "hdf5_version": h5py.version.hdf5_version,
        "python_version": platform.python_version(),
        "world_size": engine.dims.world.size,
        "tensor_parallel_size": engine.dims.tp_size, "stage": cfg.stage, "precision": cfg.precision,
        "param_dtype": str(engine.dtype).replace("torch.", ""), "state_dtype": "float32",
        "kinds": list(engine.STATE_KINDS), "lowp_kind": lowp,
        "counters": infos[0]["counters"], "scaler": infos[0]["scaler"],
        "config": to_dict(cfg),
        "tensors": tensors, "module_tensors": infos[0]["module"], "aliases": aliases,
        "files": files, "client_state": json.loads(client_json),
    }


def _space_hint(e: Exception, path: str, engine, lowp: str | None) -> str:
    """For a full disk (or a file-size limit): how much this rank's file needs and how
    much the filesystem has free."""
    text = str(e)
    if not (getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
            or "No space left" in text or "Disk quota" in text or "File too large" in text):
        return ""
    need = rank_file_bytes(engine, lowp)
    try:
        st = os.statvfs(os.path.dirname(path))
        free = f", {st.f_bavail * st.f_frsize / 2**20:.1f} MiB free there now"
    except OSError:
        free = ""
    return (f" (out of space: this rank's file needs about {need / 2**20:.1f} MiB, "
            f"{engine.dims.world.size} rank files about {engine.dims.world.size * need / 2**20:.1f} MiB{free})")


def save(engine, directory, tag: str | None = None, client_state: dict | None = None,
         keep_last: int | None = None) -> str:
    comm = engine.dims.world
    rank = comm.rank
    directory = os.path.abspath(os.fspath(directory))
    err, client_json = None, None
    try:
        client_json = fmt.client_state_json(client_state)
        tag = fmt.check_tag(f"step-{engine.global_steps}" if tag is None else tag)
        if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
            raise ValueError(f"keep_last={keep_last!r}: must be a positive int or None")
    except (TypeError, ValueError) as e:
        err = e
    fmt.raise_agreed(comm, err, "save_checkpoint")  # TypeError/ValueError, as raised

    tmp = err = None
    if rank == 0:
        try:
            os.makedirs(directory, exist_ok=True)
            tmp = tempfile.mkdtemp(prefix=f"{fmt.TMP_PREFIX}{tag}-", dir=directory)
            dirs.mark_owner(tmp)
            umask = os.umask(0o022)
            os.umask(umask)
            os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's 0700 would hide it from teammates
        except OSError as e:
            err = f"cannot create a directory in {directory}: {e}"
    fmt.raise_agreed(comm, err, f"save_checkpoint to {os.path.join(directory, tag)}")
    tmp, tag = comm.bcast_object((tmp, tag))  # rank 0's tag, should the ranks differ
    target = os.path.join(directory, tag)
    check_shared_once(engine.dims, directory, tmp)  # first save of a multi-node job: all nodes see it

    lowp = fmt.lowp_kind(engine.config.precision)
    info, err = None, None
    path = os.path.join(tmp, fmt.rank_file(rank))
    try:
        info = write_rank_file(path, engine, tag, lowp)  # fsynced; with its digest and size
    except Exception as e:  # disk full, permissions... : every rank must hear of it
        err = f"{path}: {type(e).__name__}: {e}" + _space_hint(e, path, engine, lowp)
        try:
            os.unlink(path)  # give the space back at once
        except OSError:
            pass
    comm.barrier(poll=True)  # sleep, not spin, while the slowest writer finishes (ranks > cores)
    if runtime.agree(comm, err):
        # Nobody raises before rank 0 has removed the temporary directory: an uncaught
        # error on another rank aborts the job, which would kill rank 0 mid-cleanup and
        # leave the partial checkpoint filling the disk.
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        comm.barrier()
        fmt.raise_agreed(comm, err, f"save_checkpoint to {target} (nothing was written; "
                                    f"the previous checkpoint is untouched)")
    infos = comm.allgather_object(info)  # every rank file is durable from here on

    err = None
    if rank == 0:
        try:
            manifest = _build_manifest(engine, tag, infos, client_json, lowp)
            gaps = check_coverage(manifest)  # never publish what load would reject
            if gaps:
                raise RuntimeError("exported pieces do not cover the model: " + "; ".join(gaps[:4]))
            index_path = os.path.join(tmp, fmt.INDEX)
            write_index(index_path, manifest)
            digest, size = fmt.fsync_and_hash(index_path)
            manifest["index"] = {"file": fmt.INDEX, "size": size, "digest": digest}
            atomic_write(os.path.join(tmp, fmt.MANIFEST), json.dumps(fmt.seal(manifest), indent=1))
            dirs.publish(directory, tmp, tag)
        except Exception as e:
            shutil.rmtree(tmp, ignore_errors=True)
            err = f"{type(e).__name__}: {e}"
        else:
            try:  # housekeeping: the checkpoint is already published, so only warn
                dirs.cleanup(directory)
                dirs.rotate(directory, keep_last, tag, background=True)
            except OSError as e:
                warnings.warn(f"checkpoint {target} saved, but cleaning up {directory} failed: {e}")
    comm.barrier(poll=True)  # rank 0 writes index.h5 and the manifest alone meanwhile
    fmt.raise_agreed(comm, err, f"save_checkpoint to {target}")  # rank 0's publish outcome
    return target
