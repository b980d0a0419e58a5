"""Asynchronous saves: the same checkpoint as saving.save, written in the background.

    save(engine, DIR, async_save=True)   # collective: snapshot, then training goes on
    poll(engine)                         # collective, once per step: publish a finished one
    flush(engine)                        # collective: wait for the save in flight, publish it

A save runs saving.start on every rank (arguments, rank 0's temporary directory), takes
a Snapshot into the rank's staging buffer and returns; a SaveThread copies and writes
this rank's file. Publication - the agreement that every rank wrote, index.h5, the
manifest, the rename, `latest`, rotation (saving.finish) - happens only on the training
thread, at a step boundary, under the watchdog, once every rank's write has finished:
until then the checkpoint is a hidden .tmp-* directory that load, resume, inspect and
rotation never see. At most one save is in flight; a save requested meanwhile first
waits for it and publishes it, and says how long it waited.

A background write that fails (disk full, permissions) is seen by the next poll on
every rank together and raised there as CheckpointError, with the message a synchronous
save gives; the temporary directory is removed first. Ways a run ends: flush() at its
end and on a stop signal; after an error every rank raised together (runtime.JobError,
e.g. a diverged run) the ranks still talk, so flush() is still right; after any other
exception nothing collective may run: the save in flight is simply never published and
the next successful save's cleanup removes its directory.
"""
from __future__ import annotations

import atexit
import sys
import time
import weakref

from ..runtime import watchdog
from . import saving
from .background import WRITER_KINDS, ProcessWriter, SaveThread, ThreadWriter
from .staging import Snapshot, Staging


class InFlight:
    def __init__(self, start: dict, snapshot: Snapshot, thread: SaveThread, begin_s: float, waited_s: float):
        self.start, self.snapshot, self.thread = start, snapshot, thread
        self.stall_s, self.waited_s = begin_s, waited_s


class AsyncSaver:
    """Per engine (engine._async_saver): the staging buffer and writer, allocated at the
    first asynchronous save and reused, and the save in flight."""

    def __init__(self, engine, writer: str):
        if writer not in WRITER_KINDS:
            raise ValueError(f"checkpoint writer {writer!r}: must be one of {', '.join(WRITER_KINDS)}")
        self.engine = weakref.ref(engine)
        self.kind, self.staging, self.writer = writer, None, None
        self.inflight: InFlight | None = None
        self.last: dict | None = None   # the last published save: path, tag, stall_s, write_s, waited_s
        atexit.register(_warn_unpublished, weakref.ref(self))

    def _prepare(self, engine, lowp: str | None) -> None:
        if self.staging is not None and self.staging.fits(engine, lowp):
            return
        self.close()
        self.staging = Staging(engine, lowp)
        self.writer = ProcessWriter(self.staging) if self.kind == "process" else ThreadWriter()

    def begin(self, directory, tag, client_state, keep_last) -> str:
        """Collective. Returns the path the checkpoint will have once published."""
        engine = self.engine()
        t0 = time.perf_counter()
        waited = 0.0
        if self.inflight is not None:
            prev = self.inflight.start["tag"]
            self.flush()
            waited = time.perf_counter() - t0
            _say(engine, f"checkpoint: waited {waited:.2f} s for the save of {prev} to finish before saving "
                         f"{tag or f'step-{engine.global_steps}'} (at most one save is in flight)")
        t1 = time.perf_counter()
        s = saving.start(engine, directory, tag, client_state, keep_last)
        self._prepare(engine, s["lowp"])
        snap = Snapshot(self.staging, engine, s["tag"])
        thread = SaveThread(snap, self.writer, self.staging, s["path"])
        engine._state_fence = snap.fence   # the next update waits for the copy
        thread.start()
        self.inflight = InFlight(s, snap, thread, time.perf_counter() - t1, waited)
        return s["target"]

    def poll(self) -> dict | None:
        """Collective, cheap: one small all-reduce while a save is in flight, nothing
        otherwise. Publishes the save once every rank's write finished (returns its
        record), raises CheckpointError on every rank if any rank's write failed."""
        f = self.inflight
        if f is None:
            return None
        t0 = time.perf_counter()
        world = self.engine().dims.world
        done = f.thread.finished.is_set()
        running, = world.allreduce_scalars([0.0 if done else 1.0], op="max")
        f.stall_s += time.perf_counter() - t0
        return None if running else self._publish()

    def flush(self) -> dict | None:
        """Collective: wait for this rank's write, then publish (or raise) on every rank."""
        if self.inflight is None:
            return None
        with watchdog.waiting("checkpoint background write"):
            self.inflight.thread.finished.wait()
        return self._publish()

    def _publish(self) -> dict:
        f, engine = self.inflight, self.engine()
        self.inflight = None
        t0 = time.perf_counter()
        th, s = f.thread, f.start
        info = err = None
        if th.error is not None:
            err = saving.write_error(th.error, s["path"], engine, s["lowp"])
        else:
            info = dict(f.snapshot.summary, pieces=f.snapshot.header["pieces"], elements=f.snapshot.elements,
                        module=f.snapshot.module_info(), digest=th.result[0], size=th.result[1])
        with watchdog.generous("checkpoint publish"):
            path = saving.finish(engine, s, info, err)
            write_s = max(engine.dims.world.allgather_object(th.write_s))
        stall = f.stall_s + f.snapshot.fence_s + time.perf_counter() - t0
        self.last = {"path": path, "tag": s["tag"], "stall_s": stall, "write_s": write_s, "waited_s": f.waited_s}
        return self.last

    def close(self) -> None:
        """Free the staging buffer and the writer (no save may be in flight)."""
        if self.writer is not None:
            self.writer.close()
        if self.staging is not None:
            self.staging.close()
        self.staging = self.writer = None


def _say(engine, msg: str) -> None:
    if engine.dims.world.rank == 0:
        print(f"zerompi: {msg}", file=sys.stderr, flush=True)


def _warn_unpublished(ref) -> None:
    saver = ref()
    if saver is not None and saver.inflight is not None:
        print(f"zerompi: checkpoint {saver.inflight.start['target']} was still being written at exit and is "
              "not published (call zerompi.checkpoint.flush(engine) before the end)", file=sys.stderr, flush=True)


def saver_of(engine, writer: str = "thread") -> AsyncSaver:
    saver = getattr(engine, "_async_saver", None)
    if saver is None or (saver.kind != writer and saver.inflight is None):
        if saver is not None:
            saver.close()
        saver = engine._async_saver = AsyncSaver(engine, writer)
    return saver
