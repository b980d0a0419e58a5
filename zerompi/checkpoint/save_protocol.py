"""Collective, atomic save (all ranks call it together).

1. every rank validates its arguments; the ranks agree on errors (no rank proceeds alone);
2. rank 0 creates DIR/.tmp-TAG-<random> and tells every rank its name; at the first save of a
   multi-node job, every node must see it (shared.py: else one message, nothing left);
3. each rank writes rank-XXXXX.h5, checksumming its bytes from memory as they are
   written (rankfile_engine._stream, or rankfile_h5.write_staged from a snapshot: CRC-32 per 64 MiB
   block, as checksums.digest_file computes), and fsyncs it;
4. the ranks agree on errors, then exchange piece tables (this is the barrier: every
   file is durable);
5. rank 0 writes index.h5 and manifest.json (fsynced), fsyncs the directory, renames it
   to DIR/TAG, rewrites DIR/latest (zerompi.runtime.fileio.atomic_write), cleans up crashed
   saves and applies keep_last; the ranks agree on its outcome, so all of them return
   or raise together.

An asynchronous save (background/saver.py) runs steps 1-2 (start) when it is requested, step 3
from a snapshot in the background, and steps 4-5 (finish) on the training thread once
every rank's write has finished: the same protocol, the same messages.

Every error agreement is errors.raise_agreed (zerompi.runtime.agree underneath): the
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
from ..optim import schedulers
from . import directory as dirs
from . import manifest_json, naming
from .errors import CheckpointError, raise_agreed
from .index import write_metadata
from .shared import check_once as check_shared_once
from .verify import check_coverage
from .rankfile_engine import model_tensors, rank_file_bytes, write_rank_file

_PRECISION_DTYPE = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def _build_manifest(view, tag: str, infos: list[dict], client_json: str, lowp: str | None,
                    sched_json: str | None = None) -> dict:
    from ..version import __version__
    from ..config import to_dict

    tensors = {name: {"shape": list(shape), "link": naming.link_name(name), "pieces": []}
               for name, shape in model_tensors(view)}
    for r, info in enumerate(infos):
        for name, shape, lo, hi, off in info["pieces"]:
            tensors[name]["pieces"].append([r, lo, hi, off])
    for t in tensors.values():
        t["pieces"].sort(key=lambda p: p[1])
    # Tied parameters are stored once under their first name; record the other names.
    first, aliases = {}, {}
    for name, p in view.module.named_parameters(remove_duplicate=False):
        if id(p) in first and first[id(p)] != name:
            aliases[name] = first[id(p)]
        first.setdefault(id(p), name)
    files = {naming.rank_file(r): {"rank": r, "size": i["size"], "digest": i["digest"],
                                "elements": i["elements"]} for r, i in enumerate(infos)}
    cfg = view.config
    return {
        "format": naming.FORMAT, "format_version": naming.VERSION, "tag": tag,
        "created_ns": time.time_ns(), "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        # str(): torch's TorchVersion, pickled to the background writer, would import torch there
        "zerompi_version": __version__, "torch_version": str(torch.__version__),
        "h5py_version": h5py.version.version, "hdf5_version": h5py.version.hdf5_version,
        "python_version": platform.python_version(),
        "world_size": view.dims.world.size,
        "tensor_parallel_size": view.dims.tp_size, "stage": cfg.stage, "precision": cfg.precision,
        "param_dtype": str(view.dtype).replace("torch.", ""), "state_dtype": "float32",
        "kinds": list(view.state_kinds), "lowp_kind": lowp,
        "counters": infos[0]["counters"], "scaler": infos[0]["scaler"],
        "config": to_dict(cfg),
        "tensors": tensors, "module_tensors": infos[0]["module"], "aliases": aliases,
        "files": files, "client_state": json.loads(client_json),
        "lr_scheduler": json.loads(sched_json or "null"),  # engine.lr_scheduler's state (optim/schedulers.py)
    }


def space_hint(e: Exception, path: str, need: int, world: int) -> str:
    """For a full disk (or a file-size limit): how much this rank's file needs (`need`
    bytes) and how much the filesystem has free."""
    text = str(e)
    if not (getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
            or "No space left" in text or "Disk quota" in text or "File too large" in text):
        return ""
    try:
        st = os.statvfs(os.path.dirname(path))
        free = f", {st.f_bavail * st.f_frsize / 2**20:.1f} MiB free there now"
    except OSError:
        free = ""
    return (f" (out of space: this rank's file needs about {need / 2**20:.1f} MiB, "
            f"{world} rank files about {world * need / 2**20:.1f} MiB{free})")


def write_error(e: Exception, path: str, view, lowp: str | None) -> str:
    """The one message for a rank file that could not be written; the partial file is
    removed at once, to give the space back."""
    try:
        os.unlink(path)
    except OSError:
        pass
    hint = space_hint(e, path, rank_file_bytes(view, lowp), view.dims.world.size)
    name = getattr(e, "kind", type(e).__name__)   # a helper process's error: its own class name
    return f"{path}: {name}: {e}" + hint


def start(view, directory, tag: str | None, client_state: dict | None, keep_last: int | None) -> dict:
    """Steps 1-2 (collective, one exchange): every rank checks the arguments, rank 0 (if
    its own are fine) makes the temporary directory; all learn every rank's problems and
    rank 0's directory together. Returns what step 5 (finish) needs."""
    comm = view.dims.world
    directory = os.path.abspath(os.fspath(directory))
    err, client_json, sched_json = None, None, None
    try:
        client_json = manifest_json.client_state_json(client_state)
        view.settle()  # a step decided on the device steps the scheduler when read
        sched_json = schedulers.state_json(view)
        tag = naming.check_tag(f"step-{view.global_steps}" if tag is None else tag)
        if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
            raise ValueError(f"keep_last={keep_last!r}: must be a positive int or None")
    except (TypeError, ValueError) as e:
        err = e
    tmp = dir_err = None
    if comm.rank == 0 and err is None:
        try:
            os.makedirs(directory, exist_ok=True)
            tmp = tempfile.mkdtemp(prefix=f"{naming.TMP_PREFIX}{tag}-", dir=directory)
            dirs.mark_owner(tmp)
            umask = os.umask(0o022)
            os.umask(umask)
            os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's 0700 would hide it from teammates
        except OSError as e:
            dir_err = f"cannot create a directory in {directory}: {e}"
    mine = (runtime.as_items(err), tmp, tag, dir_err)
    everyone = comm.allgather_object(mine) if comm.size > 1 else [mine]
    found = runtime.merged([e[0] for e in everyone])
    if found and tmp is not None:
        shutil.rmtree(tmp, ignore_errors=True)  # another rank's arguments were bad
    runtime.raise_found(found, comm.size, "save_checkpoint", CheckpointError, limit=8)  # TypeError/ValueError, as raised
    _, tmp, tag, dir_err = everyone[0]   # rank 0's directory and tag, should the ranks' tags differ
    runtime.raise_found(runtime.merged([runtime.as_items(dir_err)]), 1,
                        f"save_checkpoint to {os.path.join(directory, tag)}", CheckpointError)
    check_shared_once(view.dims, directory, tmp)  # first save of a multi-node job: all nodes see it
    return {"directory": directory, "tmp": tmp, "tag": tag, "target": os.path.join(directory, tag),
            "client_json": client_json, "sched_json": sched_json, "keep_last": keep_last,
            "lowp": naming.lowp_kind(view.config.precision),
            "path": os.path.join(tmp, naming.rank_file(comm.rank))}


def agree_written(view, s: dict, info: dict | None, err: str | None, all_done: bool = False) -> list[dict]:
    """Step 4 (collective, one exchange), once every rank wrote its file (info) or failed
    (err): on any failure rank 0 removes the temporary directory and every rank raises;
    else every rank gets every rank's info (the piece tables: every file is durable from
    here on). all_done: every rank is known to have finished (an asynchronous save's poll)."""
    comm = view.dims.world
    if not all_done:
        comm.barrier(poll=True)  # sleep, not spin, while the slowest writer finishes (ranks > cores)
    mine = (runtime.as_items(err), info)
    everyone = comm.allgather_object(mine) if comm.size > 1 else [mine]
    found = runtime.merged([e[0] for e in everyone])
    if found:
        # Nobody raises before rank 0 has removed the temporary directory: an uncaught
        # error on another rank aborts the job, which would kill rank 0 mid-cleanup and
        # leave the partial checkpoint filling the disk.
        if comm.rank == 0:
            shutil.rmtree(s["tmp"], ignore_errors=True)
        comm.barrier()
        runtime.raise_found(found, comm.size, f"save_checkpoint to {s['target']} (nothing was written; "
                                              f"the previous checkpoint is untouched)", CheckpointError, limit=8)
    return [e[1] for e in everyone]


def manifest_of(view, s: dict, infos: list[dict]) -> dict:
    """Rank 0: the manifest of the files written, checked: never publish what load would reject."""
    manifest = _build_manifest(view, s["tag"], infos, s["client_json"], s["lowp"], s.get("sched_json"))
    gaps = check_coverage(manifest)
    if gaps:
        raise RuntimeError("exported pieces do not cover the model: " + "; ".join(gaps[:4]))
    return manifest


def publish(view, s: dict, err: str | None) -> str:
    """Step 5's end (collective): rank 0 moves the finished temporary directory to DIR/TAG
    and rewrites DIR/latest, unless `err` (rank 0's index or manifest failed); the ranks
    agree on the outcome, so all of them return the path or raise together."""
    comm, directory, target = view.dims.world, s["directory"], s["target"]
    if comm.rank == 0:
        if err is None:
            try:
                dirs.publish(directory, s["tmp"], s["tag"])
            except Exception as e:
                err = f"{type(e).__name__}: {e}"
        if err is not None:
            shutil.rmtree(s["tmp"], ignore_errors=True)
        else:
            try:  # housekeeping: the checkpoint is already published, so only warn
                dirs.cleanup(directory)
                dirs.rotate(directory, s["keep_last"], s["tag"], background=True)
            except OSError as e:
                warnings.warn(f"checkpoint {target} saved, but cleaning up {directory} failed: {e}")
    comm.barrier(poll=True)  # rank 0 publishes alone meanwhile
    raise_agreed(comm, err, f"save_checkpoint to {target}")  # rank 0's outcome
    return target


def finish(view, s: dict, info: dict | None, err: str | None) -> str:
    """Steps 4-5 of a synchronous save (collective)."""
    infos = agree_written(view, s, info, err)
    err = None
    if view.dims.world.rank == 0:
        try:
            write_metadata(s["tmp"], manifest_of(view, s, infos))
        except Exception as e:
            err = f"{type(e).__name__}: {e}"
    return publish(view, s, err)


def save(view, directory, tag: str | None = None, client_state: dict | None = None,
         keep_last: int | None = None) -> str:
    s = start(view, directory, tag, client_state, keep_last)
    info = err = None
    try:
        info = write_rank_file(s["path"], view, s["tag"], s["lowp"])  # fsynced; with its digest and size
    except Exception as e:  # disk full, permissions... : every rank must hear of it
        err = write_error(e, s["path"], view, s["lowp"])
    return finish(view, s, info, err)
