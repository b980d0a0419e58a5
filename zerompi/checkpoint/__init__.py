"""Sharded, atomic, verified HDF5 checkpoints that load at any world size and stage.

    path = zerompi.checkpoint.save(engine, "ckpt")            # collective; -> ckpt/step-N
    client_state = zerompi.checkpoint.load(engine, "ckpt")    # collective; ckpt/latest

Layout and guarantees: docs/checkpoints.md. Modules:
  save_protocol, load_protocol   the collective save and load (all ranks together)
  rankfile_engine                one rank's file written from the engine's tensors (torch)
  rankfile_h5                    the rank file's HDF5 structure, and its write from a staging
                                 buffer (no torch: the background helper process uses it)
  index                          index.h5: virtual datasets at full shape
  directory, shared              atomic publish, latest, rotation; every node sees DIR
  verify, reader                 checks; element ranges read from rank files
  resume                         what a training run resumes from
  naming, errors, hdf5, checksums, manifest_json   the format: names, the error type, HDF5
                                 types and hyperslabs, file checksums, manifest JSON
  background/                    asynchronous saves: saver, snapshot, writers, helper
The engine is read and set only through its checkpoint view (zerompi/zero/checkpoint_view.py).
Inspect and export from the shell: `python -m zerompi.inspect`,
`python -m zerompi.export`.

Only h5py/numpy/JSON are used to read: nothing in a checkpoint can execute code.
"""
from __future__ import annotations

from .errors import CheckpointError

# Every function here takes an engine, or anything with checkpoint_view() (its view, which
# returns itself): the names it offers are all this package reads or sets
# (zerompi/zero/checkpoint_view.py).

__all__ = ["CheckpointError", "save", "poll", "flush", "load", "verify_checkpoint", "resolve", "read_manifest"]


def save(engine, directory, tag: str | None = None, client_state: dict | None = None,
         keep_last: int | None = None, async_save: bool = False, writer: str = "process") -> str:
    """Write DIR/TAG (default tag step-<global_steps>) on all ranks together and point
    DIR/latest at it; returns the checkpoint path. client_state must be JSON-serialisable
    (TypeError naming the key otherwise). keep_last=K keeps the K newest checkpoints in
    DIR and deletes older ones (never the one just written); None keeps everything.

    async_save=True snapshots the state into a host staging buffer and returns at once;
    the file is written in the background (writer "process": a helper process per rank,
    or "thread") and published
    by a later poll(engine) (call it once per step) or flush(engine) (at the end): until
    then the path does not exist and DIR/latest names the previous checkpoint. At most
    one save is in flight; a save waits for the one before (docs/checkpoints.md)."""
    from ..runtime.watchdog import generous
    from .background.saver import saver_of
    from .save_protocol import save as _save

    if async_save:
        with generous("checkpoint save"):
            return saver_of(engine.checkpoint_view(), writer).begin(directory, tag, client_state, keep_last)
    flush(engine)  # never two saves in flight, and in order
    with generous("checkpoint save"):  # ranks wait for the slowest writer
        return _save(engine.checkpoint_view(), directory, tag=tag, client_state=client_state, keep_last=keep_last)


def poll(engine) -> dict | None:
    """Collective, once per step: publish the asynchronous save in flight if every
    rank's write has finished. Returns {"path", "tag", "stall_s", "write_s", "waited_s"}
    when it published one, else None; raises CheckpointError (on every rank) if a
    background write failed. Costs one small non-blocking all-reduce per step while a
    save is in flight."""
    saver = engine.checkpoint_view().saver
    return saver.poll() if saver is not None else None


def flush(engine) -> dict | None:
    """Collective: wait for the asynchronous save in flight and publish it (as poll)."""
    saver = engine.checkpoint_view().saver
    return saver.flush() if saver is not None else None


def load(engine, directory, tag: str | None = None, verify: bool = True) -> dict | None:
    """Load DIR/TAG (default: DIR/latest; DIR may also be a checkpoint directory itself)
    on all ranks together, whatever world size and stage it was saved with. Returns its
    client_state, or None when DIR holds no checkpoint. Raises CheckpointError, on every
    rank, for a missing, incomplete, corrupt or mismatched checkpoint."""
    from ..runtime.watchdog import generous
    from .load_protocol import load as _load

    flush(engine)  # a save in flight is published (and its snapshot done) before the state changes
    with generous("checkpoint load"):  # ranks wait for the slowest hasher
        return _load(engine.checkpoint_view(), directory, tag=tag, verify=verify)


def verify_checkpoint(path, tag: str | None = None) -> dict:
    """Single-process full check (sizes, sha256, coverage, structure); the manifest."""
    from .directory import resolve as _resolve
    from .verify import verify_checkpoint as _verify

    ckpt = _resolve(path, tag)
    if ckpt is None:
        raise CheckpointError(f"{path}: no checkpoint here")
    return _verify(ckpt)


def resolve(path, tag: str | None = None) -> str | None:
    from .directory import resolve as _resolve

    return _resolve(path, tag)


def read_manifest(ckpt) -> dict:
    from .verify import read_manifest as _read

    return _read(ckpt)
