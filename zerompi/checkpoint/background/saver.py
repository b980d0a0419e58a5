"""Asynchronous saves: the same checkpoint as save_protocol.save, written in the background.

    save(engine, DIR, async_save=True)   # collective: snapshot, then training goes on
    poll(engine)                         # collective, once per step: advance, publish
    flush(engine)                        # collective: finish the save in flight, publish

A save runs save_protocol.start on every rank (arguments, rank 0's temporary directory), takes
a Snapshot into the rank's staging buffer and returns. Then, each step advanced by a
poll once every rank's part of it has finished:
  write  every rank's background task copies the snapshot and writes its file;
  meta   the ranks agree that all files are written (save_protocol.agree_written: the piece
         tables are exchanged, or everyone raises); rank 0's background task writes
         index.h5 and manifest.json (about a second of HDF5 calls for a GPT-2-sized model,
         which would otherwise stall every rank);
  publish  rank 0 renames the directory to DIR/TAG and rewrites `latest` on the training
         thread, at a step boundary, under the watchdog; the ranks agree on the outcome.
Until then the checkpoint is a hidden .tmp-* directory that load, resume, inspect and
rotation never see. At most one save is in flight: a save requested meanwhile first
finishes and publishes it, and says how long it waited.

A background failure (disk full, permissions) is raised by the next poll on every rank
together as CheckpointError, with the message a synchronous save gives, after rank 0
removed the temporary directory. Ways a run ends: flush() at its end and on a stop
signal; after an error every rank raised together (runtime.JobError, e.g. a diverged
run) the ranks still talk, so flush() is still right; after any other exception nothing
collective may run: the save in flight is never published, and the next successful
save's cleanup removes its directory.
"""
from __future__ import annotations

import atexit
import sys
import time
import weakref

from ...runtime import watchdog
from ...runtime.console import say
from .. import save_protocol
from .writers import WRITER_KINDS, WRITER_NICE, ProcessWriter, Task, ThreadWriter, save_task
from .snapshot import Snapshot, Staging
from ..rankfile_engine import module_tensors


class InFlight:
    def __init__(self, start: dict, snapshot: Snapshot, task: Task, stall_s: float, waited_s: float):
        self.start, self.snapshot, self.task = start, snapshot, task
        self.phase = "write"
        self.stall_s, self.waited_s, self.write_s = stall_s, waited_s, 0.0
        self.parts = {"begin_s": stall_s, "poll_s": 0.0, "agree_s": 0.0, "publish_s": 0.0}  # where the stall went
        self.meta_err: str | None = None
        self.asked = None   # the poll's all-reduce posted at the previous step boundary


class AsyncSaver:
    """Per engine (its checkpoint view's saver slot): the staging buffer and writer, allocated at the
    first asynchronous save and reused, and the save in flight."""

    def __init__(self, view, writer: str, nice: int = WRITER_NICE):
        if writer not in WRITER_KINDS:
            raise ValueError(f"checkpoint writer {writer!r}: must be one of {', '.join(WRITER_KINDS)}")
        self.view = weakref.ref(view)   # the engine holds the view, the view this saver
        self.kind, self.nice, self.staging, self.writer = writer, nice, None, None
        self.inflight: InFlight | None = None
        self.published: list[dict] = []   # path, tag, stall_s, write_s, waited_s of each published save
        atexit.register(_warn_unpublished, weakref.ref(self))

    def _prepare(self, view, lowp: str | None, mods: list) -> None:
        if self.staging is not None and self.staging.fits(view, lowp, mods):
            return
        self.close()
        self.staging = Staging(view, lowp, mods)
        if self.kind == "process" and self.staging.fd is None:   # no memfd (not Linux): no helper can map it
            say("checkpoint: writer process needs memfd_create; writing in a thread instead",
                rank=view.dims.world.rank)
            self.kind = "thread"
        self.writer = ProcessWriter(self.staging, self.nice) if self.kind == "process" else ThreadWriter(self.nice)

    def prepare(self) -> None:
        """Allocate the staging buffer, touch its pages and start the writer now (a
        trainer's set-up) instead of at the first save, where page faults would slow
        the snapshot copy and a helper process would start while training runs."""
        from .. import naming

        view = self.view()
        self._prepare(view, naming.lowp_kind(view.config.precision), module_tensors(view))
        self.staging.mem.zero_()

    def begin(self, directory, tag, client_state, keep_last) -> str:
        """Collective. Returns the path the checkpoint will have once published."""
        view = self.view()
        t0 = time.perf_counter()
        waited = 0.0
        if self.inflight is not None:
            prev = self.inflight.start["tag"]
            self.flush()
            waited = time.perf_counter() - t0
            say(f"checkpoint: waited {waited:.2f} s for the save of {prev} to finish before saving "
                f"{tag or f'step-{view.global_steps}'} (at most one save is in flight)", rank=view.dims.world.rank)
        t1 = time.perf_counter()
        s = save_protocol.start(view, directory, tag, client_state, keep_last)
        try:
            mods = module_tensors(view)   # frozen parameters and buffers: (name, tensor, role)
            self._prepare(view, s["lowp"], mods)
            snap = Snapshot(self.staging, view, s["tag"], mods)
            task = save_task(snap, self.writer, self.staging, s["path"])
            view.set_fence(snap.fence)   # the next update waits for the copy
        except Exception as e:   # e.g. no host memory for the staging buffer: reported by the next poll
            snap, task = None, Task("zerompi-ckpt-save", _raiser(RuntimeError(
                f"cannot take the snapshot: {type(e).__name__}: {e}")))
        task.start()
        self.inflight = InFlight(s, snap, task, time.perf_counter() - t1, waited)
        return s["target"]

    def poll(self) -> dict | None:
        """Collective, cheap: while a save is in flight, one small non-blocking all-reduce
        per step, nothing otherwise. Advances the save once every rank's part of its
        current step is done; returns its record when it was published.

        Each poll reads the all-reduce the previous poll posted (by now complete: the
        step's own collectives progressed it) and posts the next. A blocking all-reduce
        here waited each step for the slowest rank, which the step's next collective
        waits for anyway: at stage 3 that wait was most of an asynchronous save's stall.
        The answer is one step old, and the same on every rank, so every rank advances
        at the same poll."""
        f = self.inflight
        if f is None:
            return None
        t0 = time.perf_counter()
        running = 1.0
        if f.asked is not None:
            running, = f.asked.wait()
            f.asked = None
        if running:
            done = f.task is None or f.task.finished.is_set()
            f.asked = self.view().dims.world.start_allreduce_scalars([0.0 if done else 1.0], op="max")
        f.stall_s += time.perf_counter() - t0
        f.parts["poll_s"] += time.perf_counter() - t0
        return None if running else self._advance()

    def flush(self) -> dict | None:
        """Collective: finish the save in flight and publish it (or raise, on every rank)."""
        rec = None
        if self.inflight is not None and self.inflight.asked is not None:
            self.inflight.asked.wait()   # every rank posted it at the same poll
            self.inflight.asked = None
        while self.inflight is not None:
            task = self.inflight.task
            if task is not None:   # the deadline of saves (startup_timeout_s), as for a synchronous one
                with watchdog.generous("checkpoint save"), watchdog.waiting("checkpoint background write"):
                    task.finished.wait()
            rec = self._advance()
        return rec

    def _advance(self) -> dict | None:
        f, view = self.inflight, self.view()
        t0 = time.perf_counter()
        try:
            with watchdog.generous("checkpoint publish"):
                rec = self._write_done(f, view) if f.phase == "write" else self._publish(f, view)
        except BaseException:
            self.inflight = None   # raised on every rank: nothing left to finish
            raise
        dt = time.perf_counter() - t0
        f.stall_s += dt
        f.parts["agree_s" if rec is None else "publish_s"] += dt
        if rec is not None:
            rec["stall_s"] += dt
        return rec

    def _write_done(self, f: InFlight, view) -> None:
        s, task = f.start, f.task
        info = err = None
        if task.error is not None:
            err = save_protocol.write_error(task.error, s["path"], view, s["lowp"])
        else:
            info = dict(f.snapshot.summary, pieces=f.snapshot.header["pieces"], elements=f.snapshot.elements,
                        module=f.snapshot.module_info(), digest=task.result[0], size=task.result[1],
                        write_s=task.seconds)
        infos = save_protocol.agree_written(view, s, info, err, all_done=True)   # raises on every rank if any failed
        f.write_s = max(i["write_s"] for i in infos)
        f.phase, f.task = "meta", None
        if view.dims.world.rank == 0:
            try:
                manifest = save_protocol.manifest_of(view, s, infos)
            except Exception as e:
                f.meta_err = f"{type(e).__name__}: {e}"
            else:
                f.task = Task("zerompi-ckpt-meta", lambda: self.writer.write_meta(s["tmp"], manifest))
                f.task.start()
        return None

    def _publish(self, f: InFlight, view) -> dict:
        err = f.meta_err
        if f.task is not None and f.task.error is not None:
            e = f.task.error
            err = f"{getattr(e, 'kind', type(e).__name__)}: {e}"
        path = save_protocol.publish(view, f.start, err)
        self.inflight = None
        rec = {"path": path, "tag": f.start["tag"], "stall_s": f.stall_s + f.snapshot.fence_s,
               "write_s": f.write_s, "waited_s": f.waited_s, "parts": dict(f.parts, fence_s=f.snapshot.fence_s)}
        self.published.append(rec)
        return rec

    def drain(self) -> list[dict]:
        """The saves published since the last call (a save that waited for the one
        before published that one itself)."""
        out, self.published = self.published, []
        return out

    def close(self) -> None:
        """Free the staging buffer and the writer (no save may be in flight)."""
        if self.writer is not None:
            self.writer.close()
        if self.staging is not None:
            self.staging.close()
        self.staging = self.writer = None


def _raiser(e: Exception):
    def fail():
        raise e
    return fail


def _warn_unpublished(ref) -> None:
    saver = ref()
    if saver is not None and saver.inflight is not None:
        print(f"zerompi: checkpoint {saver.inflight.start['target']} was still being written at exit and is "
              "not published (call zerompi.checkpoint.flush(engine) before the end)", file=sys.stderr, flush=True)


def saver_of(view, writer: str = "process") -> AsyncSaver:
    """The engine's saver (view: engine.checkpoint_view()), made or remade for `writer`."""
    saver = view.saver
    if saver is None or (saver.kind != writer and saver.inflight is None):
        if saver is not None:
            saver.close()
        saver = view.saver = AsyncSaver(view, writer)
    return saver
