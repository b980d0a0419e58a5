"""engine.optimizer is a torch.optim.Optimizer (zerompi/optim/base.py): torch's LR
schedulers attach to it, the update reads the groups' lr and betas every step, and the
engine steps a scheduler it was given after each applied update. One process (the
multi-rank, every-stage and resume checks: tests/multirank/test_schedulers.py)."""
from __future__ import annotations

import pytest
import torch

import zerompi
from zerompi.optim import decay_groups
from tiny_model import Tiny


def _batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 6, generator=g)


def _reference(make_sched, steps, groups=False):
    m = Tiny()
    opt = torch.optim.AdamW(decay_groups(m, 0.1) if groups else m.parameters(), lr=0.01, weight_decay=0.01,
                            foreach=False)
    sched = make_sched(opt)
    lrs = []
    for s in range(steps):
        opt.zero_grad()
        m(_batch(s)).backward()
        opt.step()
        sched.step()
        lrs.append([g["lr"] for g in opt.param_groups])
    return m, lrs


SCHEDS = {
    "lambda": lambda o: torch.optim.lr_scheduler.LambdaLR(o, [lambda s: 0.9 ** s, lambda s: 1.0 / (1 + s)]),
    "onecycle": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=8),
    "cosine": lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=5, eta_min=1e-4),
    "sequential": lambda o: torch.optim.lr_scheduler.SequentialLR(
        o, [torch.optim.lr_scheduler.LinearLR(o, 0.1, 1.0, total_iters=3),
            torch.optim.lr_scheduler.ExponentialLR(o, 0.8)], milestones=[3]),
}


@pytest.mark.parametrize("kind", sorted(SCHEDS))
def test_torch_schedulers_drive_the_engine_like_torch_adamw(kind):
    """Same model, batches and scheduler: the engine (stage 0, fp32, one rank) tracks
    torch.optim.AdamW, learning rates per step equal and parameters to rounding. OneCycleLR
    cycles betas[0] too: the update must read it every step."""
    groups = kind == "lambda"  # one lambda per user group: the hidden default group must not count
    ref, ref_lrs = _reference(SCHEDS[kind], 8, groups)
    m = Tiny()
    engine = zerompi.initialize(m, {"stage": 0, "gradient_clipping": 0.0,
                                    "optimizer": {"lr": 0.01, "weight_decay": 0.01}},
                                param_groups=decay_groups(m, 0.1) if groups else None)
    assert isinstance(engine.optimizer, torch.optim.Optimizer)
    assert len(engine.optimizer.param_groups) == (2 if groups else 1)
    engine.lr_scheduler = SCHEDS[kind](engine.optimizer)
    lrs = []
    for s in range(8):
        engine.backward(engine(_batch(s)))
        engine.step()
        lrs.append([g["lr"] for g in engine.param_groups])
    assert lrs == ref_lrs
    sd = engine.full_state_dict()
    for n, p in ref.named_parameters():
        torch.testing.assert_close(sd[n], p.detach(), rtol=0, atol=1e-6)


def test_scheduler_steps_once_per_applied_update_with_accumulation():
    m = Tiny()
    engine = zerompi.initialize(m, {"stage": 1, "gradient_accumulation_steps": 3})
    engine.lr_scheduler = torch.optim.lr_scheduler.StepLR(engine.optimizer, step_size=1, gamma=0.5)
    for s in range(7):
        engine.backward(engine(_batch(s)))
        engine.step()
    assert engine.global_steps == 2 and engine.lr_scheduler.last_epoch == 2
    assert engine.param_groups[0]["lr"] == pytest.approx(engine.config.optimizer.lr / 4)


def test_torch_habits_are_safe():
    """optimizer.step() from user code is refused (it would skip reduction, unscaling and
    clipping); zero_grad() leaves the engine's accumulation alone; state_dict() has torch's
    structure and names where the moments are; load_state_dict refuses moment tensors."""
    m = Tiny()
    engine = zerompi.initialize(m, {"stage": 2})
    opt = engine.optimizer
    with pytest.raises(RuntimeError, match="engine.step"):
        opt.step()
    with pytest.raises(RuntimeError, match="engine.step"):
        opt.step(lambda: 0.0)
    engine.backward(engine(_batch(0)))
    opt.zero_grad()
    engine.step()
    assert engine.global_steps == 1 and engine.last_grad_norm > 0
    sd = opt.state_dict()
    assert sorted(sd["param_groups"][0]["params"]) == list(range(4))
    assert {int(v["step"]) for v in sd["state"].values()} == {1}
    assert "save_checkpoint" in sd["zerompi"]
    sd["param_groups"][0]["lr"] = 0.123
    sd["state"][0]["step"] = torch.tensor(7.0)
    opt.load_state_dict(sd)
    assert engine.param_groups[0]["lr"] == 0.123 and 7 in opt.steps
    sd["state"][0]["exp_avg"] = torch.zeros(3)
    with pytest.raises(ValueError, match="exp_avg.*load_checkpoint"):
        opt.load_state_dict(sd)
