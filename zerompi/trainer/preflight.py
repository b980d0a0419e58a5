"""What `python -m zerompi.train` settles after the config and node layout and before it
imports torch (train.py): the data every rank reads and the architecture of the checkpoint
a resume would load. So bad data, per-node copies that differ or a checkpoint of another
model end a job of any size in the time its ranks take to start, before any model is
built. Both only read; the run directory is claimed (`claim`) once the device is agreed
too, so that a config error leaves nothing behind. Nothing here may import torch (the
tests of these failures run with it unimportable: test_reliability.py, test_train_data.py,
test_prepare_train.py).

Collective over `world`: a zerompi Communicator or a bare one (runtime.agree.ObjectComm)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ..checkpoint.resume import ResumeError
from ..data import default_corpus
from ..data.sources import Data, open_agreed_data
from ..models.arch import ARCHITECTURE, record
from ..runtime import rundir, same_everywhere
from ..runtime.rundir import RunLock


@dataclass
class Preflight:
    data: Data              # the checked train/val tokens
    data_state: dict        # what the data order depends on (saved, compared on resume)
    spec: str               # the train data as opened (the default corpus's path)
    lock: RunLock | None = None  # rank 0's hold on run_dir (claim(); freed at exit)

    def claim(self, cfg, nodes, world) -> None:
        """Collective: take run_dir for this job (one job per run_dir), or RunDirBusy on
        every rank."""
        self.lock = rundir.claim(Path(cfg.run_dir), world, nodes.local_rank)


def preflight(cfg, nodes, world) -> Preflight | None:
    """Open and agree the data, check the resume's architecture; None once rank 0 printed
    the job's one error line (bad data), ResumeError raised on every rank together."""
    if world.rank == 0:
        print(f"zerompi.train: {nodes.describe()}: {nodes.listing()}", flush=True)
    if cfg.data == "default":
        if world.rank == 0:
            default_corpus()  # build the cache once, not on every rank at the same time
        world.allgather_object(None)  # a barrier under the set-up deadline: the cache is complete
    spec = str(default_corpus()) if cfg.data == "default" else cfg.data
    # Format, size and a sample of ids checked before any step; the rest as batches are read.
    data = open_agreed_data(cfg, cfg.model.shape().vocab_size, cfg.seq_len, spec, world)
    if data is None:
        return None
    # fingerprints agree, or ResumeError: per-rank files that differ go silently wrong
    data_state = agreed_data_state(world, cfg, data.train.tokens, data.val.tokens)
    if cfg.resume:  # another family or shape is said as such, before anything is built or loaded
        check_architecture_first(world, Path(cfg.run_dir) / "checkpoints", cfg.resume_from,
                                 model_state(cfg.model.shape()))
    return Preflight(data, data_state, spec)


def model_state(shape) -> dict:
    """The train CLI's architecture record (saved in checkpoints, compared on resume): the
    family and its shape (a GPTConfig or LlamaConfig), models/arch.py."""
    return record(shape)


def agreed_data_state(world, cfg, train_tokens, val_tokens) -> dict:
    """What the data order depends on besides the step (saved in checkpoints, compared on
    resume), after checking that every rank reads the same tokens (collective)."""
    from ..data import fingerprint

    state = {"spec": cfg.data, "val": cfg.data_val, "order": cfg.data_order, "seed": cfg.seed,
             "global_batch": cfg.global_batch,
             "block_size": cfg.seq_len, "fingerprint": fingerprint(train_tokens)}
    differ = same_everywhere(world, {"train": state["fingerprint"], "val": fingerprint(val_tokens)}, "data set")
    if differ:
        raise ResumeError(differ[0] + f" (--data {cfg.data} must be the same tokens on every rank)")
    return state


def check_architecture_first(world, ckpt_dir, resume_from: str, model: dict) -> None:
    """Collective, before the engine loads anything: a resume_from that names no
    checkpoint is the ResumeError resume() would raise, and the checkpoint a resume tries
    first (resume_from, else latest) records this architecture, or ResumeError naming the
    key, on every rank. (The loader would fail on parameter names, without saying why.) A
    checkpoint whose manifest cannot be read is left to the loader's own checks."""
    msg = None
    if world.rank == 0:
        from ..checkpoint import CheckpointError, verify
        from ..checkpoint.resume import candidates

        try:
            paths, _ = candidates(os.path.abspath(ckpt_dir), resume_from)
        except (ResumeError, CheckpointError, OSError) as e:  # resume()'s own words, said sooner
            paths, msg = [], str(e)
        except Exception:  # noqa: BLE001 - rank 0 alone: never leave the others in the bcast below
            paths = []
        try:
            saved = (verify.read_manifest(paths[0]).get("client_state") or {}).get("model") if paths else None
        except Exception:  # noqa: BLE001 - resume() reports what is wrong with the directory
            saved = None
        arch = compare(saved, model, ARCHITECTURE) if isinstance(saved, dict) else []
        msg = another_architecture(arch) if arch else msg
    msg = world.bcast_object(msg, root=0)
    if msg:
        raise ResumeError(msg)


def compare(saved: dict, now: dict, keys) -> list[tuple[str, object, object]]:
    """(key, saved value, current value) for each of `keys` (dotted) that differs;
    keys absent from the saved dict (older checkpoints) are skipped."""
    out = []
    for key in keys:
        a, b, ok = saved, now, True
        for part in key.split("."):
            if not (isinstance(a, dict) and part in a):
                ok = False
                break
            a, b = a[part], b[part]
        if ok and a != b:
            out.append((key, a, b))
    return out


def another_architecture(arch) -> str:
    arch = [d for d in arch if d[0] == "family"] or arch  # another family: that says it all
    return ("the checkpoint holds another model architecture: " + "; ".join(
        f"model {k}: checkpoint {a!r}, config {b!r}" for k, a, b in arch)
        + " (same parameter shapes do not make the same model); use another --run_dir")
