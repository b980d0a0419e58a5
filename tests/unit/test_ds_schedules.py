"""zerompi/optim/ds_schedules.py against DeepSpeed's own schedulers (tests/support/
ds_lr_module.py: its lr_schedules.py out of the DeepSpeed wheel) on the same torch
optimizers, step by step: learning rates, betas (OneCycle), state_dict and resume; and
against the written-out formulas of tests/support/ds_schedulers.py where that holds them."""
from __future__ import annotations

import pytest
import torch

import ds_lr_module
from ds_schedulers import DeepSpeedScheduler
from zerompi.config import ConfigError
from zerompi.optim import ds_schedules

DS = ds_lr_module.load()
needs_ds = pytest.mark.skipif(DS is None, reason="no DeepSpeed wheel or install to read lr_schedules.py from")

BLOCKS = [
    ("WarmupLR", {"warmup_num_steps": 7}),
    ("WarmupLR", {"warmup_min_lr": 1e-4, "warmup_max_lr": 3e-3, "warmup_num_steps": 5, "warmup_type": "linear"}),
    ("WarmupDecayLR", {"total_num_steps": 20, "warmup_num_steps": 6}),
    ("WarmupDecayLR", {"total_num_steps": 12, "warmup_min_lr": 1e-5, "warmup_max_lr": 0.02, "warmup_num_steps": 4,
                       "warmup_type": "linear"}),
    ("WarmupCosineLR", {"total_num_steps": 18, "warmup_num_steps": 5}),
    ("WarmupCosineLR", {"total_num_steps": 10, "warmup_min_ratio": 0.1, "warmup_num_steps": 3,
                        "cos_min_ratio": 0.05, "warmup_type": "linear"}),
    ("OneCycle", {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-2, "cycle_first_step_size": 4}),
    ("OneCycle", {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-2, "cycle_first_step_size": 5, "cycle_second_step_size": 3,
                  "cycle_first_stair_count": 2, "decay_step_size": 2, "decay_lr_rate": 0.5, "decay_mom_rate": 0.1,
                  "cycle_min_mom": 0.85, "cycle_max_mom": 0.95}),
]


def _opt(kind="adamw"):
    ps = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))]
    groups = [{"params": ps[:1], "lr": 0.004}, {"params": ps[1:], "lr": 0.002}]
    return torch.optim.AdamW(groups, betas=(0.9, 0.95)) if kind == "adamw" else torch.optim.SGD(groups, momentum=0.9)


def _trace(sched, opt, steps):
    out = [[(g["lr"], tuple(g.get("betas", ()))) for g in opt.param_groups]]
    for _ in range(steps):
        sched.step()
        out.append([(g["lr"], tuple(g.get("betas", ()))) for g in opt.param_groups])
    return out


@needs_ds
@pytest.mark.parametrize("kind,params", BLOCKS, ids=[f"{k}-{i}" for i, (k, _) in enumerate(BLOCKS)])
@pytest.mark.parametrize("opt_kind", ["adamw", "sgd"])
def test_matches_deepspeed(kind, params, opt_kind):
    ref_opt, our_opt = _opt(opt_kind), _opt(opt_kind)
    ref = getattr(DS, kind)(ref_opt, **params)
    ours = ds_schedules.from_block(our_opt, {"type": kind, "params": params})
    want, got = _trace(ref, ref_opt, 25), _trace(ours, our_opt, 25)
    for step, (w, g) in enumerate(zip(want, got)):
        for (wl, wb), (gl, gb) in zip(w, g):
            assert gl == pytest.approx(wl, rel=1e-12, abs=1e-15), (step, w, g)
            assert gb == pytest.approx(wb, rel=1e-12), (step, w, g)
    assert ours.state_dict() == ref.state_dict()
    # resume: a fresh scheduler loaded at step k continues as DeepSpeed's does
    opt2 = _opt(opt_kind)
    again = ds_schedules.from_block(opt2, {"type": kind, "params": params})
    again.load_state_dict(ours.state_dict())
    ref.step()
    again.step()
    assert [g["lr"] for g in opt2.param_groups] == pytest.approx([g["lr"] for g in ref_opt.param_groups], rel=1e-12)


@pytest.mark.parametrize("kind,params", [b for b in BLOCKS if b[0] in ("WarmupLR", "WarmupCosineLR")
                                         and b[1].get("warmup_type") == "linear"])
def test_matches_the_written_out_formulas(kind, params):
    """Without the wheel too: the linear warm-ups against tests/support/ds_schedulers.py."""
    opt = _opt()
    ours = ds_schedules.from_block(opt, {"type": kind, "params": params})
    ref = DeepSpeedScheduler(kind, 0.004, **params)
    for _ in range(20):
        assert opt.param_groups[0]["lr"] == pytest.approx(ref.lr, rel=1e-12, abs=1e-15)
        ours.step()
        ref.step()


def test_refusals_name_the_key():
    with pytest.raises(ConfigError, match="scheduler.type.*LRRangeTest"):
        ds_schedules.from_block(_opt(), {"type": "LRRangeTest", "params": {}})
    with pytest.raises(ConfigError, match="scheduler.params.warmup_steps"):
        ds_schedules.from_block(_opt(), {"type": "WarmupLR", "params": {"warmup_steps": 3}})
    with pytest.raises(ConfigError, match="scheduler.params.total_num_steps"):
        ds_schedules.from_block(_opt(), {"type": "WarmupDecayLR", "params": {}})
    with pytest.raises(ConfigError, match="warmup_num_steps.*auto"):
        ds_schedules.from_block(_opt(), {"type": "WarmupLR", "params": {"warmup_num_steps": "auto"}})
    s = ds_schedules.from_block(_opt(), {"type": "WarmupLR", "params": {"warmup_num_steps": "auto"}},
                                fill={"warmup_num_steps": 3})
    assert s.warmup == 3
