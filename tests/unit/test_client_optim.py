"""zerompi.initialize(optimizer=, lr_scheduler=) as deepspeed.initialize takes them
(zerompi/zero/client_optim.py): what maps onto the engine's optimizer, what is refused
by name, and schedulers given as instances (on the user's optimizer), factories or a
DeepSpeed config block. One process; multi-rank: tests/multirank/test_schedulers.py."""
from __future__ import annotations

import pytest
import torch

import zerompi
from zerompi.config import ConfigError
from zerompi.optim import decay_groups
from tiny_model import Tiny

L = torch.optim.lr_scheduler


def _run(engine_or_opt, steps, sched=None):
    lrs = []
    for s in range(steps):
        x = torch.randn(8, 6, generator=torch.Generator().manual_seed(s))
        if isinstance(engine_or_opt, tuple):
            model, opt = engine_or_opt
            opt.zero_grad()
            model(x).backward()
            opt.step()
            sched.step()
            lrs.append([g["lr"] for g in opt.param_groups])
        else:
            engine_or_opt.backward(engine_or_opt(x))
            engine_or_opt.step()
            lrs.append([g["lr"] for g in engine_or_opt.param_groups])
    return lrs



def init(*args, **kwargs):
    """zerompi.initialize's engine: a call with DeepSpeed's arguments returns DeepSpeed's
    4-tuple (integrations/initialize.py); torch.distributed is not needed here."""
    out = zerompi.initialize(*args, dist_init_required=False, **kwargs)
    return out[0]

CFG = {"stage": 1, "gradient_clipping": 0.0}


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.AdamW(ps, lr=0.02, betas=(0.8, 0.9), weight_decay=0.05, foreach=False),
    lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01, foreach=False),
    lambda ps: torch.optim.Adagrad(ps, lr=0.05, lr_decay=0.01, initial_accumulator_value=0.1, foreach=False),
], ids=["adamw", "sgd", "adagrad"])
def test_an_optimizer_instance_and_its_scheduler_carry_over(make):
    """The user's optimizer (two groups) with a LambdaLR already built on it: the engine
    takes its kind, groups and the scheduler, and tracks the same torch loop."""
    ref_model = Tiny()
    ref_opt = make(decay_groups(ref_model, 0.1))
    ref_sched = L.LambdaLR(ref_opt, [lambda s: 0.8 ** s, lambda s: 1.0 / (1 + s)])
    want = _run((ref_model, ref_opt), 6, ref_sched)
    model = Tiny()
    opt = make(decay_groups(model, 0.1))
    sched = L.LambdaLR(opt, [lambda s: 0.8 ** s, lambda s: 1.0 / (1 + s)])
    engine = init(model, CFG, optimizer=opt, lr_scheduler=sched)
    assert engine.lr_scheduler is sched and sched.optimizer is engine.optimizer
    assert engine.config.optimizer.type == type(opt).__name__.lower()
    assert len(engine.param_groups) == 2
    assert _run(engine, 6) == want
    sd = engine.full_state_dict()
    for n, p in ref_model.named_parameters():
        torch.testing.assert_close(sd[n], p.detach(), rtol=0, atol=1e-6)


def test_classes_factories_and_model_parameters():
    e = init(Tiny(), CFG, optimizer=torch.optim.AdamW,
                           lr_scheduler=lambda o: L.StepLR(o, 1, gamma=0.5))
    assert e.config.optimizer.lr == 1e-3 and e.config.optimizer.weight_decay == 0.01  # torch's defaults
    _run(e, 2)
    assert e.param_groups[0]["lr"] == pytest.approx(1e-3 / 4)
    m = Tiny()
    e = init(m, CFG, model_parameters=decay_groups(m, 0.2))
    assert [g["weight_decay"] for g in e.param_groups] == [0.2, 0.0]
    adam = init(Tiny(), CFG, optimizer=lambda ps: torch.optim.Adam(ps, lr=0.01))
    assert adam.config.optimizer.type == "adamw" and adam.config.optimizer.weight_decay == 0.0


class Adafactor(torch.optim.Optimizer):
    def __init__(self, params):
        super().__init__(params, {"lr": 0.1})


@pytest.mark.parametrize("opt,match", [
    (lambda ps: torch.optim.LBFGS(ps), "LBFGS: needs a closure"),
    (Adafactor, "Adafactor: factors the second moment"),
    (lambda ps: torch.optim.RMSprop(ps), "RMSprop: not an optimizer zerompi partitions"),
    (lambda ps: torch.optim.Adam(ps, weight_decay=0.1), "L2 decay"),
    (lambda ps: torch.optim.AdamW(ps, amsgrad=True), "amsgrad"),
    (lambda ps: torch.optim.SGD(ps, lr=0.1, maximize=True), "maximize"),
])
def test_refused_optimizers_are_named(opt, match):
    with pytest.raises(ValueError, match=match):
        init(Tiny(), CFG, optimizer=opt)


def test_refusals_of_the_arguments():
    m = Tiny()
    with pytest.raises(ValueError, match="not in its param groups.*a.weight"):
        init(m, CFG, optimizer=torch.optim.SGD([m.b.weight, m.b.bias, m.a.bias], lr=0.1))
    with pytest.raises(ValueError, match="ReduceLROnPlateau"):
        init(Tiny(), CFG, lr_scheduler=L.ReduceLROnPlateau)
    with pytest.raises(ValueError, match="param_groups or optimizer"):
        init(m, CFG, optimizer=torch.optim.AdamW, param_groups=decay_groups(m, 0.1))


def test_a_deepspeed_scheduler_block_becomes_engine_lr_scheduler():
    ds = {"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 2},
          "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
          "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 6, "warmup_num_steps": 2,
                                                             "warmup_max_lr": 0.01, "warmup_type": "linear"}}}
    e = init(Tiny(), ds)
    assert type(e.lr_scheduler).__name__ == "DeepSpeedLR" and e.param_groups[0]["lr"] == 0.0
    assert [lr[0] for lr in _run(e, 6)] == pytest.approx([0.0, 0.005, 0.01, 0.0075, 0.005, 0.0025])  # after updates 0..5
    # a scheduler argument wins over the block, as in DeepSpeed
    e = init(Tiny(), ds, lr_scheduler=lambda o: L.StepLR(o, 1))
    assert isinstance(e.lr_scheduler, L.StepLR)
    ds["scheduler"]["params"]["warmup_num_steps"] = "auto"
    with pytest.raises(ConfigError, match="scheduler.params.warmup_num_steps.*auto"):
        init(Tiny(), ds)


def test_a_checkpoint_of_another_optimizer_is_refused(tmp_path):
    """SGD's momentum buffer sits where AdamW's exp_avg does: loading one's checkpoint into
    the other's engine must fail, naming both, not train on with the wrong state."""
    sgd = init(Tiny(), CFG, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))
    _run(sgd, 1)
    sgd.save_checkpoint(tmp_path / "sgd")
    adamw = init(Tiny(), CFG)
    with pytest.raises(Exception, match="another optimizer.*adamw"):
        adamw.load_checkpoint(tmp_path / "sgd")
    again = init(Tiny(), CFG, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))
    again.load_checkpoint(tmp_path / "sgd")
    assert again.global_steps == 1 and again.optimizer.steps == sgd.optimizer.steps
