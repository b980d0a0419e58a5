"""What a run resumes from, decided once by rank 0, and what changed since it was saved.

    client = resume(engine, world, ckpt_dir, resume_from="", override_optimizer=False,
                    saved_vs_now=...)        # collective

- Rank 0 picks the candidates: `resume_from` (a tag in ckpt_dir, or a checkpoint
  path) alone; otherwise the one `latest` names, then every other complete checkpoint,
  newest first. Every rank then checks that it can see the chosen one (a node-local
  or unmounted directory fails naming the ranks, instead of hanging or splitting).
- A candidate that fails verification (load checks sizes and checksums on all ranks),
  or whose manifest.json is missing (rank 0 cannot see it either: damage, not a mount
  problem), is reported loudly and the next older one is tried; an explicit resume_from never falls
  back. No checkpoint at all is said loudly too: the run starts fresh.
- The optimizer hyper-parameters the checkpoint brings (betas, eps, weight_decay per
  parameter group) are compared with the config's: a difference is an error unless
  `override_optimizer`, which applies the config's values and logs them.
The trainer's own checks of what changed since the save (architecture, schedule, data)
are zerompi/trainer/checkpoints.py's.
"""
from __future__ import annotations

import os

from .. import runtime
from ..runtime import JobError
from . import directory as dirs
from . import naming
from .errors import CheckpointError
from ..runtime.console import say

HYPER = ("betas", "eps", "weight_decay")


class ResumeError(JobError):
    exit_code = 2  # like a bad config: the command needs changing, not a retry


def candidates(ckpt_dir: str, resume_from: str) -> tuple[list[str], list[str]]:
    """(checkpoint paths to try in order, warnings). Runs on rank 0 only."""
    if resume_from:
        paths = (resume_from, os.path.join(ckpt_dir, resume_from))
        for path in paths:
            if os.path.isfile(os.path.join(path, naming.MANIFEST)):
                return [os.path.abspath(path)], []
        for path in paths:
            if os.path.isdir(path) and not os.path.exists(os.path.join(path, naming.LATEST)):
                raise ResumeError(f"--resume_from {resume_from}: {_no_manifest(path)}")
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


def _no_manifest(path: str) -> str:
    return (f"{os.path.join(path, naming.MANIFEST)}: missing (not a complete zerompi checkpoint: "
            "damaged, or a save that never finished)")


def _hyper(view) -> list[dict]:
    return [{k: (tuple(float(x) for x in g[k]) if k == "betas" else float(g[k])) for k in HYPER}
            for g in view.param_groups]


def resume(engine, world, ckpt_dir, resume_from: str = "", override_optimizer: bool = False) -> dict | None:
    """Load the checkpoint to resume from into `engine` (collective over `world`, which
    must hold every rank of the engine); returns its client_state, or None for a fresh run."""
    view = engine.checkpoint_view()
    ckpt_dir = os.path.abspath(os.fspath(ckpt_dir))
    found, err = ([], []), None
    if world.rank == 0:
        try:
            found = candidates(ckpt_dir, resume_from)
        except (ResumeError, CheckpointError, OSError) as e:
            err = str(e)
    problems = runtime.agree(world, err)
    if problems:
        raise ResumeError(problems[0][2])
    paths, notes = world.bcast_object(found)
    for n in notes:
        say(f"WARNING: {n}", rank=world.rank)
    if not paths:
        say(f"no checkpoint in {ckpt_dir}: starting a FRESH run at step 0", rank=world.rank)
        return None

    wanted = _hyper(view)
    for i, path in enumerate(paths):
        # Rank 0 chose it; a rank that cannot even see it points at the filesystem. When
        # rank 0 cannot either, the directory has no manifest: damaged, or a save that
        # never finished, to be skipped like any other damage.
        blind = [r for r, _, _ in runtime.agree(
            world, None if os.path.isfile(os.path.join(path, naming.MANIFEST)) else "blind")]
        if blind and blind[0] != 0:
            raise ResumeError(f"rank{'s' if len(blind) > 1 else ''} {', '.join(map(str, blind))} cannot see "
                              f"checkpoint {path}, which rank 0 chose: is the run directory on a "
                              "filesystem every node mounts?")
        try:
            if blind:
                raise CheckpointError(_no_manifest(path))
            client = view.load_checkpoint(path)
        except CheckpointError as e:
            if resume_from:
                raise ResumeError(f"--resume_from {resume_from}: {e}") from None
            say(f"WARNING: checkpoint {path} is damaged and is skipped:\n  {e}", rank=world.rank)
            continue
        if i > 0:
            say(f"WARNING: RESUMING FROM AN OLDER CHECKPOINT, {path}: the newer ones above "
                "failed verification (pass --resume_from TAG|PATH to choose another)", rank=world.rank)
        _check_optimizer(view, world, wanted, override_optimizer)
        return client
    raise ResumeError(f"no checkpoint in {ckpt_dir} verifies (each is listed above); start fresh with "
                      "--resume false or another --run_dir, or repair one")


def _check_optimizer(view, world, wanted: list[dict], override: bool) -> None:
    saved = _hyper(view)  # the checkpoint's, now installed
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
    for g, w in zip(view.param_groups, wanted):
        g.update({k: (tuple(w[k]) if k == "betas" else w[k]) for k in HYPER})
    say(f"override_optimizer: using the config's optimizer hyper-parameters: {text}", rank=world.rank)
