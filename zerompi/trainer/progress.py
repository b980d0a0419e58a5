"""Rank 0's console and metrics output for `python -m zerompi.train`.

`progress = "auto"` (the default) draws a tqdm bar with ETA and tokens/s when the user
is watching a terminal, and prints plain lines otherwise (Slurm logs, pipes): step 1,
every `log_interval`-th step, evaluations and the last step, each with the time left.
Under `mpiexec` a rank's stdout is a pipe to the launcher even when the user sits at a
terminal, so the check looks through the launcher processes to the stream they forward
to (see `watching_terminal`). Every step goes to metrics.jsonl whatever is shown.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

# Processes that forward a rank's output: the terminal question is theirs to answer.
# Slurm's slurmstepd is not here on purpose: under srun the output is a job log, or is
# relayed by srun on another process tree, and plain lines suit both.
_LAUNCHERS = {"hydra_pmi_proxy", "mpiexec", "mpiexec.hydra", "mpirun", "orted", "prted", "prterun"}


def _fd1(pid: int | str) -> str:
    try:
        return os.readlink(f"/proc/{pid}/fd/1")
    except OSError:
        return ""


def _is_tty_path(target: str) -> bool:
    return target.startswith(("/dev/pts/", "/dev/tty")) or target == "/dev/console"


def watching_terminal(stream=None) -> bool:
    """True when `stream` (default stdout) ends at a terminal, directly or through the
    MPI launcher's forwarding (rank -> hydra_pmi_proxy -> mpiexec -> the user's tty)."""
    stream = sys.stdout if stream is None else stream
    try:
        if stream.isatty():
            return True
    except (AttributeError, ValueError):
        return False
    if not os.path.isdir("/proc/self/fd"):
        return False  # no /proc (macOS): a pipe is a pipe
    if not _fd1("self").startswith(("pipe:", "socket:")):
        return False  # a file or /dev/null: a log, not a person
    pid = os.getppid()
    for _ in range(4):  # rank -> proxy -> mpiexec; never past the launcher
        try:
            with open(f"/proc/{pid}/comm") as f:
                comm = f.read().strip()
            with open(f"/proc/{pid}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return False
        if comm not in _LAUNCHERS:
            return False  # e.g. a test harness reading our pipe
        target = _fd1(pid)
        if _is_tty_path(target):
            return True
        if not target.startswith(("pipe:", "socket:")):
            return False
        pid = parent
    return False


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB"):
        if n < 1024:
            return f"{n:.1f}MB" if unit == "MB" else f"{n:.0f}{unit}"
        n /= 1024
    return f"{n:.1f}GB"


def fmt_duration(s: float) -> str:
    s = int(round(max(0.0, s)))
    h, rem = divmod(s, 3600)
    return f"{h}:{rem // 60:02d}:{rem % 60:02d}" if h else f"{rem // 60}:{rem % 60:02d}"


def finish_message(max_steps: int, start_step: int, elapsed: float) -> str:
    """The last line of a run. After a resume the timer covers only this run's steps,
    so the line says which part that is (the issue-16 'done in N s' confusion)."""
    ran = max_steps - start_step
    if start_step == 0:
        return f"done, {max_steps} steps in {elapsed:.1f}s"
    return (f"done, {max_steps} steps: resumed at step {start_step}, ran {ran} steps "
            f"in {elapsed:.1f}s (this run only)")


def batch_note(global_batch: int, grad_accum: int, dp: int) -> str | None:
    """A line for rank 0 when the batch does not split evenly over the ranks, or None.
    Uneven rows are handled exactly (losses are weighted by rows; tests/system/test_train.py),
    but silently wasting a rank's time surprised users, so say it."""
    from ..data.tokens import shard_range

    counts = [[b - a for a, b in (shard_range(m1 - m0, r, dp) for r in range(dp))]
              for m0, m1 in (shard_range(global_batch, m, grad_accum) for m in range(grad_accum))]
    flat = [c for micro in counts for c in micro]
    if len(set(flat)) == 1:
        return None
    even = dp * grad_accum
    note = (f"note: global_batch {global_batch} in {grad_accum} micro-step(s) does not split evenly "
            f"over {dp} data-parallel ranks ({min(flat)} to {max(flat)} rows per rank and micro-step). "
            f"The update is still exact (losses are weighted by rows), but ranks with fewer rows wait "
            f"for the others")
    if min(flat) == 0:
        idle = sorted({r for micro in counts for r, c in enumerate(micro) if c == 0})
        note += (f"; rank(s) {', '.join(map(str, idle))} get no rows in some micro-steps and compute "
                 "a borrowed row weighted 0")
    return note + f". For equal work use a global_batch that is a multiple of {even}."


class Progress:
    """Rank 0's output: every step to metrics.jsonl; a tqdm bar or plain lines to stdout.
    Other ranks get a silent one (`active=False`)."""

    def __init__(self, cfg, metrics_path: Path, start_step: int, mfu_label: str, active: bool):
        self.cfg, self.mfu_label, self.active, self.bar = cfg, mfu_label, active, None
        self.start_step, self.t0 = start_step, time.perf_counter()
        self.show = cfg.progress
        if self.show == "auto":
            self.show = "bar" if active and watching_terminal() else "lines"
        self.file = open(metrics_path, "a", buffering=1) if active else None
        self.sinks = None  # TensorBoard, W&B: the same records (sinks.py)
        if active and (cfg.tensorboard or cfg.wandb):
            from ..config import to_dict
            from .sinks import Sinks

            self.sinks = Sinks(cfg, metrics_path.parent, start_step, to_dict(cfg))
        if active and self.show == "bar":
            from tqdm import tqdm

            # tqdm's own ETA and rate come from the steps of this run only, so a resumed
            # run's ETA is not skewed by the steps it skipped.
            self.bar = tqdm(total=cfg.max_steps, initial=start_step, unit="step", dynamic_ncols=True,
                            file=sys.stdout, smoothing=0.1)

    def eta(self, step: int) -> float:
        """Seconds left, from the mean step time of this run so far."""
        done = step - self.start_step
        return (time.perf_counter() - self.t0) / max(1, done) * (self.cfg.max_steps - step)

    def update(self, rec: dict) -> None:
        if not self.active:
            return
        self.file.write(json.dumps(rec) + "\n")
        if self.sinks is not None:
            self.sinks.log(rec)
        step, val = rec["step"], rec.get("val_loss")
        tput = f"{rec['tokens_per_s']:,.0f} tok/s"
        if self.bar is not None:
            # Cheap per step (no redraw); the bar redraws at its own pace.
            self.bar.set_postfix_str(f"loss {rec['loss']:.4f}" + (f" val {val:.4f}" if val is not None else "")
                                     + f" {tput}", refresh=False)
            self.bar.update(1)
            return
        first = step == self.start_step + 1
        if self.show != "lines" or (step % self.cfg.log_interval and step != self.cfg.max_steps
                                    and val is None and not first):
            return
        mem = f" rss {fmt_bytes(rec['rss'])} states {fmt_bytes(rec['model_state_bytes'])}"
        print(f"step {step}/{self.cfg.max_steps} loss {rec['loss']:.4f}"
              + (f" val_loss {val:.4f}" if val is not None else "")
              + f" lr {rec['lr']:.2e} {tput} {self.mfu_label} {100 * rec['mfu']:.2f}%" + mem
              + f" eta {fmt_duration(self.eta(step))}", flush=True)

    def note(self, message: str) -> None:
        """One line from rank 0 between steps (above the bar, if there is one)."""
        if not self.active:
            return
        if self.bar is not None:
            self.bar.write(f"zerompi.train: {message}")
        else:
            print(f"zerompi.train: {message}", flush=True)

    def close(self, message: str) -> None:
        if self.active:
            if self.bar is not None:
                self.bar.close()
            self.file.close()
            if self.sinks is not None:
                self.sinks.close()
            print(f"zerompi.train: {message}", flush=True)
