"""The engine's learning-rate scheduler, as DeepSpeed's engine drives one.

An lr_scheduler given to zerompi.initialize (a torch.optim.lr_scheduler over
engine.optimizer, or one built from a DeepSpeed `scheduler` block, ds_schedules.py)
becomes engine.lr_scheduler. The engine steps it once after each applied optimizer
update (not after micro-steps that only accumulate, nor after an update skipped for a
non-finite gradient), so user code does not call scheduler.step() itself. On a GPU with
the step's statistics read a step late (zero/step_coef.py) the scheduler steps when that
update is settled: before the next update, or when global_steps is read.

engine.save_checkpoint stores its state_dict() in the checkpoint's manifest (JSON:
torch's schedulers hold numbers, lists and strings; a LambdaLR's functions are not
saved, as in torch, and are taken from the scheduler the new engine was given);
engine.load_checkpoint restores it into the new engine's scheduler.
"""
from __future__ import annotations

import json


def applied(engine, norm: float, issued: bool) -> bool:
    """An update is applied with gradient norm `norm`: record it; step the scheduler now
    if the update was issued already (read a step late), else once it is (after_update)."""
    engine._last_grad_norm = norm
    if issued:
        _step(engine)
    else:
        engine._lr_step_due = True
    return True


def after_update(engine) -> None:
    """The end of an accumulation boundary (ZeroEngine._zero_grads): the update decided
    before it was issued has now read its learning rates."""
    if getattr(engine, "_lr_step_due", False):
        engine._lr_step_due = False
        _step(engine)


def _step(engine) -> None:
    if engine.lr_scheduler is not None:
        engine.lr_scheduler.step()


def state_json(engine) -> str | None:
    """The scheduler's state as JSON text (None: the engine has none); TypeError naming
    the entry that is not JSON."""
    sched = engine.lr_scheduler
    if sched is None:
        return None
    state = sched.state_dict()
    try:
        return json.dumps(state)
    except (TypeError, ValueError) as e:
        bad = sorted(k for k, v in state.items() if not _json_ok(v))
        raise TypeError(f"engine.lr_scheduler ({type(sched).__name__}): its state_dict() entries {bad} are not "
                        f"JSON ({e}); the checkpoint stores JSON only") from None


def load_state(engine, state: dict | None) -> None:
    """Restore a saved scheduler state into engine.lr_scheduler (if both exist)."""
    if state is None or engine.lr_scheduler is None:
        return
    engine.lr_scheduler.load_state_dict(state)


def _json_ok(v) -> bool:
    try:
        json.dumps(v)
        return True
    except (TypeError, ValueError):
        return False
