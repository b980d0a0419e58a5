"""`python -m zerompi.train`'s checkpoints: run_dir/checkpoints/step_NNNNNNN every
checkpoint_interval steps (in the background with checkpoint.async_save), and at the end
and on a stop signal (always at once, after the save in flight is published).

Every published save goes into the metrics of the step that published it, as
"checkpoints": [{"tag", "stall_s" (time the training loop was blocked by it),
"write_s" (time its files took to write, the slowest rank's), "waited_s" (time it
waited for the save before it)}], and rank 0 prints one line for it.

On resume (checkpoint/resume.py picks and loads the checkpoint), `check_train_changes`
compares what the save recorded with this run: another architecture is an error naming
the key; schedule and data changes are logged.
"""
from __future__ import annotations

import time

from .. import runtime
from ..checkpoint import flush, poll, save
from ..checkpoint.background.saver import saver_of
from ..checkpoint.resume import ResumeError
from ..models.arch import ARCHITECTURE
from ..runtime.console import say
from .preflight import another_architecture, compare


class TrainCheckpoints:
    def __init__(self, engine, ckpt_dir, cfg, note):
        self.engine, self.dir, self.cfg, self.note = engine, ckpt_dir, cfg, note
        self.published: list[dict] = []
        if cfg.checkpoint.async_save:   # staging buffer and writer ready before the first step
            saver_of(engine.checkpoint_view(), cfg.checkpoint.writer).prepare()

    def save(self, step: int, client_state: dict, final: bool) -> None:
        """Collective. keep_last rotates old checkpoints once the new one is in place,
        keeping at least 2: the newest is not known good until a later step was finite."""
        keep = self.cfg.keep_last and max(self.cfg.keep_last, 2) or None
        tag = f"step_{step:07d}"
        if self.cfg.checkpoint.async_save and not final:
            save(self.engine, self.dir, tag=tag, client_state=client_state, keep_last=keep, async_save=True,
                 writer=self.cfg.checkpoint.writer)
            self._collect()   # the save before, if this one had to wait for it
            return
        self.flush()
        t0 = time.perf_counter()
        save(self.engine, self.dir, tag=tag, client_state=client_state, keep_last=keep)
        dt = time.perf_counter() - t0
        self._published({"tag": tag, "stall_s": dt, "write_s": dt, "waited_s": 0.0}, background=False)

    def poll(self) -> None:
        """Collective, once per step: publish the background save if every rank is done."""
        poll(self.engine)
        self._collect()

    def flush(self) -> None:
        """Collective: finish and publish the background save in flight, if any."""
        flush(self.engine)
        self._collect()

    def _collect(self) -> None:
        saver = self.engine.checkpoint_view().saver
        # a save that had to wait published the one before it itself: collect every one
        for rec in (saver.drain() if saver is not None else []):
            self._published(rec, background=True)

    def _published(self, rec: dict, background: bool) -> None:
        rec = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in rec.items() if k not in ("path", "parts")}
        self.published.append(rec)
        how = (f"stall {rec['stall_s']:.3f} s, background write {rec['write_s']:.2f} s"
               + (f", waited {rec['waited_s']:.2f} s for the save before" if rec["waited_s"] else "")
               if background else f"{rec['stall_s']:.2f} s")
        self.note(f"checkpoint {rec['tag']} saved ({how})")

    def take(self) -> list[dict]:
        """The saves published since the last call (for this step's metrics)."""
        out, self.published = self.published, []
        return out


SCHEDULE = ("max_steps", "lr_schedule", "warmup_steps", "warmup_start_lr", "lr_decay_steps", "min_lr",
            "zero.optimizer.lr")
DATA = ("spec", "val", "order", "seed", "global_batch", "block_size", "fingerprint")


def check_train_changes(world, client: dict | None, config: dict, model: dict, data: dict,
                        counts: dict) -> None:
    """`python -m zerompi.train`'s start checks (collective): the per-step counts that
    drive collectives (`counts`, plus the start step) agree across ranks; against what
    save() stored, another architecture is an error naming the key, schedule and data
    changes are logged."""
    counts = dict(counts, start_step=int(client["step"]) if client else 0)
    differ = runtime.same_everywhere(world, counts, "step plan")
    if differ:
        raise ResumeError(differ[0])
    if not client:
        return
    arch = compare(client.get("model", {}), model, ARCHITECTURE)
    if arch:
        raise ResumeError(another_architecture(arch))
    for k, a, b in compare(client.get("config", {}), config, SCHEDULE):
        say(f"schedule changed since the checkpoint: {k} {a!r} -> {b!r}; the learning rate "
            f"follows the new schedule from step {client.get('step')}", rank=world.rank)
    # checkpoints from before data_order existed were trained in random order
    changed = compare({"order": "random", **client.get("data", {})}, data, DATA)
    if changed:
        say("WARNING: resuming with different " + ", ".join(f"{k} ({a!r} -> {b!r})" for k, a, b in changed)
            + " than the checkpoint: the data order will not match an uninterrupted run", rank=world.rank)

