"""What a run resumes from, decided once by rank 0, and what changed since it was saved.

    client = resume(engine, world, ckpt_dir, resume_from="", override_optimizer=False,
                    saved_vs_now=...)        # collective

- Rank 0 picks the candidates: `resume_from` (a tag in ckpt_dir, or a checkpoint
  path) alone; otherwise the one `latest` names, then every other complete checkpoint,
  newest first. Every rank then checks that it can see the chosen one (a node-local
  or unmounted directory fails naming the ranks, instead of hanging or splitting).
- A candidate that fails verification (load checks sizes and sha256 on all ranks) is
  reported loudly and the next older one is tried; an explicit resume_from never falls
  back. No checkpoint at all is said loudly too: the run starts fresh.
- The optimizer hyper-parameters the checkpoint brings (betas, eps, weight_decay per
  parameter group) are compared with the config's: a difference is an error unless
  `override_optimizer`, which applies the config's values and logs them.
- `compare(saved, now)` pairs give the caller's own checks: architecture keys (error),
  schedule and other keys (logged).
"""
from __future__ import annotations

import os

from .. import runtime
from ..runtime import JobError
from . import directory as dirs
from . import format as fmt
from .format import CheckpointError
from ..runtime.console import say

HYPER = ("betas", "eps", "weight_decay")


class ResumeError(JobError):
    exit_code = 2  # like a bad config: the command needs changing, not a retry


def _say(world, msg: str) -> None:
    say(msg, rank=world.rank)


def _candidates(ckpt_dir: str, resume_from: str) -> tuple[list[str], list[str]]:
    """(checkpoint paths to try in order, warnings). Runs on rank 0 only."""
    if resume_from:
        for path in (resume_from, os.path.join(ckpt_dir, resume_from)):
            if os.path.isfile(os.path.join(path, fmt.MANIFEST)):
                return [os.path.abspath(path)], []
        tags = [t for _, t in dirs.list_checkpoints(ckpt_dir)] if os.path.isdir(ckpt_dir) else []
        raise ResumeError(f"--resume_from {resume_from}: no checkpoint there nor in {ckpt_dir} "
                          f"(checkpoints there: {', '.join(tags) or 'none'})")
    if not os.path.isdir(ckpt_dir):
        return [], []
    out, notes = [], []
    try:
        first = dirs.resolve(ckpt_dir)
        if first:
            out.append(first)
    except CheckpointError as e:
        notes.append(f"{e}; looking for the newest checkpoint that verifies")
    for _, tag in reversed(dirs.list_checkpoints(ckpt_dir)):
        path = os.path.join(ckpt_dir, tag)
        if path not in out:
            out.append(path)
    return out, notes


def _hyper(engine) -> list[dict]:
    return [{k: (tuple(float(x) for x in g[k]) if k == "betas" else float(g[k])) for k in HYPER}
            for g in engine.param_groups]


def resume(engine, world, ckpt_dir, resume_from: str = "", override_optimizer: bool = False) -> dict | None:
    """Load the checkpoint to resume from into `engine` (collective over `world`, which
    must hold every rank of the engine); returns its client_state, or None for a fresh run."""
    ckpt_dir = os.path.abspath(os.fspath(ckpt_dir))
    found, err = ([], []), None
    if world.rank == 0:
        try:
            found = _candidates(ckpt_dir, resume_from)
        except (ResumeError, CheckpointError, OSError) as e:
            err = str(e)
    problems = runtime.agree(world, err)
    if problems:
        raise ResumeError(problems[0][2])
    candidates, notes = world.bcast_object(found)
    for n in notes:
        _say(world, f"WARNING: {n}")
    if not candidates:
        _say(world, f"no checkpoint in {ckpt_dir}: starting a FRESH run at step 0")
        return None

    wanted = _hyper(engine)
    for i, path in enumerate(candidates):
        # Rank 0 chose it; a rank that cannot even see it points at the filesystem.
        blind = [r for r, _, _ in runtime.agree(
            world, None if os.path.isfile(os.path.join(path, fmt.MANIFEST)) else "blind")]
        if blind:
            raise ResumeError(f"rank{'s' if len(blind) > 1 else ''} {', '.join(map(str, blind))} cannot see "
                              f"checkpoint {path}, which rank 0 chose: is the run directory on a "
                              "filesystem every node mounts?")
        try:
            client = engine.load_checkpoint(path)
        except CheckpointError as e:
            if resume_from:
                raise ResumeError(f"--resume_from {resume_from}: {e}") from None
            _say(world, f"WARNING: checkpoint {path} is damaged and is skipped:\n  {e}")
            continue
        if i > 0:
            _say(world, f"WARNING: RESUMING FROM AN OLDER CHECKPOINT, {path}: the newer ones above "
                        "failed verification (pass --resume_from TAG|PATH to choose another)")
        _check_optimizer(engine, world, wanted, override_optimizer)
        return client
    raise ResumeError(f"no checkpoint in {ckpt_dir} verifies (each is listed above); start fresh with "
                      "--resume false or another --run_dir, or repair one")


def _check_optimizer(engine, world, wanted: list[dict], override: bool) -> None:
    saved = _hyper(engine)  # the checkpoint's, now installed
    diffs = [(gi, k, s[k], w[k]) for gi, (s, w) in enumerate(zip(saved, wanted)) for k in HYPER if s[k] != w[k]]
    if len(saved) != len(wanted):
        diffs.append((None, "param groups", len(saved), len(wanted)))
    if not diffs:
        return
    text = "; ".join(f"{'' if gi is None else f'param group {gi} '}{k}: checkpoint {s}, config {w}"
                     for gi, k, s, w in diffs)
    if not override or len(saved) != len(wanted):
        raise ResumeError(f"the config changes optimizer hyper-parameters of the checkpoint ({text} "
                          "[zero.optimizer.*]); pass --override_optimizer true to train on with the "
                          "config's values, or restore them")
    for g, w in zip(engine.param_groups, wanted):
        g.update({k: (tuple(w[k]) if k == "betas" else w[k]) for k in HYPER})
    _say(world, f"override_optimizer: using the config's optimizer hyper-parameters: {text}")


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


ARCHITECTURE = ("n_layer", "n_head", "n_embd", "vocab_size", "block_size", "bias")
SCHEDULE = ("max_steps", "lr_schedule", "warmup_steps", "warmup_start_lr", "lr_decay_steps", "min_lr",
            "zero.optimizer.lr")
DATA = ("spec", "seed", "global_batch", "block_size", "fingerprint")


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
        raise ResumeError("the checkpoint holds another model architecture: " + "; ".join(
            f"model {k}: checkpoint {a!r}, config {b!r}" for k, a, b in arch)
            + " (same parameter shapes do not make the same model); use another --run_dir")
    for k, a, b in compare(client.get("config", {}), config, SCHEDULE):
        _say(world, f"schedule changed since the checkpoint: {k} {a!r} -> {b!r}; the learning rate "
                    f"follows the new schedule from step {client.get('step')}")
    changed = compare(client.get("data", {}), data, DATA)
    if changed:
        _say(world, "WARNING: resuming with different " + ", ".join(f"{k} ({a!r} -> {b!r})" for k, a, b in changed)
             + " than the checkpoint: the data order will not match an uninterrupted run")


def model_state(gpt_cfg) -> dict:
    """The train CLI's architecture record (saved in checkpoints)."""
    return {k: getattr(gpt_cfg, k) for k in ARCHITECTURE}


def agreed_data_state(world, cfg, train_tokens, val_tokens) -> dict:
    """What the data order depends on besides the step (saved in checkpoints, compared on
    resume), after checking that every rank reads the same tokens (collective)."""
    from ..data import fingerprint

    state = {"spec": cfg.data, "seed": cfg.seed, "global_batch": cfg.global_batch,
             "block_size": cfg.seq_len, "fingerprint": fingerprint(train_tokens)}
    differ = runtime.same_everywhere(world, {"train": state["fingerprint"], "val": fingerprint(val_tokens)},
                                     "data set")
    if differ:
        raise ResumeError(differ[0] + f" (--data {cfg.data} must be the same tokens on every rank)")
    return state
