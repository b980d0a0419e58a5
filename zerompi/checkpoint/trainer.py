"""`python -m zerompi.train`'s checkpoints: run_dir/checkpoints/step_NNNNNNN every
checkpoint_interval steps (in the background with checkpoint.async_save), and at the end
and on a stop signal (always at once, after the save in flight is published).

Every published save goes into the metrics of the step that published it, as
"checkpoints": [{"tag", "stall_s" (time the training loop was blocked by it),
"write_s" (time its files took to write, the slowest rank's), "waited_s" (time it
waited for the save before it)}], and rank 0 prints one line for it.
"""
from __future__ import annotations

import time

from . import flush, poll, save
from .async_save import saver_of


class TrainCheckpoints:
    def __init__(self, engine, ckpt_dir, cfg, note):
        self.engine, self.dir, self.cfg, self.note = engine, ckpt_dir, cfg, note
        self.published: list[dict] = []
        if cfg.checkpoint.async_save:   # staging buffer and writer ready before the first step
            saver_of(engine, cfg.checkpoint.writer).prepare()

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
        saver = getattr(self.engine, "_async_saver", None)
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
