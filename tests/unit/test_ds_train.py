"""`python -m zerompi.train --deepspeed_config`: the DeepSpeed file as DeepSpeed means it,
merged with --config and the command line by one rule printed at start (with the
effective optimizer, schedule, precision, clipping and batch); "auto" keeps --config's
settings; WarmupLR / WarmupCosineLR run exactly as DeepSpeed's schedulers do. Every
config here is written for these tests. A whole run of the trainer on such a file:
tests/system/test_train_deepspeed.py."""
import json
import math

import pytest
import torch

from zerompi.config import ConfigError
from zerompi.config import deepspeed
from zerompi.optim import ds_schedules
from zerompi.trainer.config import TrainConfig, from_argv
from zerompi.trainer.schedule import lr_at, position

RUN = """
global_batch = 12
warmup_steps = 7
min_lr = 1e-5
[zero]
precision = "bf16"
gradient_clipping = 0.5
[zero.optimizer]
lr = 2e-4
betas = [0.9, 0.95]
eps = 1e-6
weight_decay = 0.1
"""
HF = {"bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto", "loss_scale": 0},
      "optimizer": {"type": "AdamW", "params": {k: "auto" for k in ("lr", "betas", "eps", "weight_decay")}},
      "scheduler": {"type": "WarmupDecayLR", "params": {k: "auto" for k in (
          "warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "total_num_steps")}},
      "zero_optimization": {"stage": 2, "overlap_comm": True, "reduce_bucket_size": "auto"},
      "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "train_batch_size": "auto",
      "train_micro_batch_size_per_gpu": "auto"}


@pytest.fixture
def train(tmp_path, monkeypatch):
    def make(ds, run=RUN, args=(), ranks=1):
        (tmp_path / "ds.json").write_text(json.dumps(ds))
        (tmp_path / "run.toml").write_text(run)
        monkeypatch.setattr(deepspeed, "ranks", lambda: ranks, raising=False)  # the trainer's ranks, in one process
        return from_argv(["--config", str(tmp_path / "run.toml"), "--deepspeed_config", str(tmp_path / "ds.json"),
                          *args])
    return make


def test_auto_keeps_the_runs_precision_optimizer_schedule_and_batch(train, capsys):
    cfg = train(HF)
    z = cfg.zero
    assert z.precision == "bf16" and z.stage == 2
    assert (z.optimizer.lr, z.optimizer.betas, z.optimizer.eps, z.optimizer.weight_decay) == (2e-4, (0.9, 0.95),
                                                                                              1e-6, 0.1)
    assert z.gradient_clipping == 0.5 and cfg.global_batch == 12 and z.gradient_accumulation_steps == 1
    # the block's type with the run's numbers, as DeepSpeed builds it after the HF integration fills "auto"
    # in (warmup_type absent: DeepSpeed's default, log)
    assert (cfg.lr_schedule, cfg.warmup_steps, cfg.warmup_type, cfg.warmup_start_lr, cfg.lr_decay_steps) == \
        ("deepspeed_warmup_decay", 7, "log", 0.0, 0)
    out = capsys.readouterr().out
    assert out.count('"auto" keeps this run\'s own setting for 15 key(s): bf16.enabled, fp16.enabled, ') == 1, out
    assert "schedule WarmupDecayLR, log warm-up, by applied updates" in out
    fp16 = train(HF, RUN.replace('"bf16"', '"fp16"')).zero  # fp16 through "auto": DeepSpeed's scaler
    assert fp16.precision == "fp16" and (fp16.fp16.initial_scale, fp16.fp16.window) == (2.0**16, 1000)
    with pytest.raises(ConfigError) as e:  # "auto" on bf16, but the fp16 block says no to the run's fp16
        train(dict(HF, fp16={"enabled": False}), RUN.replace('"bf16"', '"fp16"'))
    assert e.value.key == "deepspeed_config.fp16.enabled"


def test_missing_optimizer_keys_and_clipping_mean_deepspeeds_defaults(train, capsys):
    ds = {"train_micro_batch_size_per_gpu": 3, "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}}}
    cfg = train(ds)
    o = cfg.zero.optimizer
    assert (o.lr, o.betas, o.eps, o.weight_decay) == (3e-4, (0.9, 0.999), 1e-8, 0.0)
    assert cfg.zero.gradient_clipping == 1.0  # DeepSpeed >= 0.19.3's default; --config's 0.5 is replaced
    assert cfg.zero.precision == "fp32" and cfg.global_batch == 3  # no bf16 block: DeepSpeed trains fp32
    out = capsys.readouterr().out
    rule = [line for line in out.splitlines() if "which side wins" in line]
    assert len(rule) == 1 and "--key value on the command line beats both" in rule[0]
    for change in ("zero.precision bf16 -> fp32", "zero.optimizer.weight_decay 0.1 -> 0,",
                   "zero.optimizer.betas (0.9, 0.95) -> (0.9, 0.999)", "zero.gradient_clipping 0.5 -> 1"):
        assert change in rule[0], rule[0]
    assert "gradient_clipping absent: DeepSpeed's default 1" in out
    assert train(dict(ds, gradient_clipping=0)).zero.gradient_clipping == 0.0
    torch_adam = {"type": "Adam", "params": {"lr": 3e-4, "torch_adam": True}}  # torch.optim.AdamW's default
    assert train(dict(ds, optimizer=torch_adam)).zero.optimizer.weight_decay == 0.01
    # the command line beats both, and the rule says so
    cfg = train(ds, args=["--zero.optimizer.weight_decay", "0.2"])
    assert cfg.zero.optimizer.weight_decay == 0.2
    assert "the command line replaced the file's zero.optimizer.weight_decay" in capsys.readouterr().out


def test_startup_line_has_the_effective_settings_and_the_batch_over_data_parallel_ranks(train, capsys):
    ds = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
          "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.05}}, "gradient_clipping": 1.0}
    tp = ["--zero.tensor_parallel_size", "2"]
    cfg = train(ds, args=tp, ranks=4)  # 4 ranks = dp 2 x tp 2
    assert cfg.global_batch == 16 and cfg.zero.gradient_accumulation_steps == 4
    line = [x for x in capsys.readouterr().out.splitlines() if ", in effect: " in x]
    assert len(line) == 1 and line[0].endswith(
        "optimizer AdamW lr 0.0003, betas (0.9, 0.999), eps 1e-08, weight_decay 0.05 (biases and norms 0: the "
        "trainer's groups), bias-corrected, decoupled; schedule the trainer's own (the file has no scheduler): "
        "linear warm-up to 0.0003 over 7 steps, cosine to 1e-05 at step 1000; precision bf16 (gradients reduced "
        "in bf16, accumulated in bf16); clipping at global L2 norm 1; batch 16 = micro 2 x accumulation 4 x 2 "
        "data-parallel ranks (4 / tensor_parallel_size 2)"), line
    with pytest.raises(ConfigError) as e:
        train(dict(ds, gradient_accumulation_steps=2), args=tp, ranks=4)
    assert e.value.key == "deepspeed_config.train_batch_size" and "(4 ranks / zero.tensor_parallel_size 2)" in \
        e.value.why


def test_deepspeed_lr_below_min_lr_says_where_each_came_from(train, tmp_path):
    with pytest.raises(ConfigError) as e:
        train({"optimizer": {"type": "AdamW", "params": {"lr": 5e-6}}})
    assert e.value.key == "deepspeed_config.optimizer.params.lr"
    assert f"from the DeepSpeed file {tmp_path / 'ds.json'}" in e.value.why and \
        f"min_lr = 1e-05 from --config {tmp_path / 'run.toml'}" in e.value.why
    assert train({"optimizer": {"type": "AdamW", "params": {"lr": 5e-6}}}, args=["--min_lr", "0"]).min_lr == 0


LINEAR = {"warmup_type": "linear"}
SCHEDULES = [("WarmupLR", {"warmup_min_lr": 1e-5, "warmup_max_lr": 3e-4, "warmup_num_steps": 5, **LINEAR}),
             ("WarmupLR", {"warmup_num_steps": 1, **LINEAR}),  # DeepSpeed warms up over at least 2
             ("WarmupLR", {"warmup_min_lr": 1e-5, "warmup_num_steps": 6}),  # log: DeepSpeed's default
             ("WarmupDecayLR", {"total_num_steps": 20, "warmup_num_steps": 5, "warmup_min_lr": 1e-5, **LINEAR}),
             ("WarmupDecayLR", {"total_num_steps": 12, "warmup_num_steps": 4}),  # peak: DeepSpeed's 0.001
             ("WarmupDecayLR", {k: "auto" for k in ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps",
                                                    "total_num_steps")}),  # the HF template
             ("WarmupLR", {k: "auto" for k in ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps")}),
             ("WarmupCosineLR", {"total_num_steps": 20, "warmup_num_steps": 5, "warmup_min_ratio": 0.1,
                                 "cos_min_ratio": 0.01, **LINEAR}),
             ("WarmupCosineLR", {"total_num_steps": 25, "warmup_num_steps": 5, "warmup_min_ratio": 0.1}),
             ("WarmupCosineLR", {"total_num_steps": 3, "warmup_num_steps": 4, **LINEAR})]  # no decay window
# what the Hugging Face integration writes for "auto": the run's numbers (lr 1e-3 below)
HF_FILL = {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 7, "total_num_steps": 30}


@pytest.mark.parametrize("kind, params", SCHEDULES)
def test_warmup_schedules_map_exactly_in_applied_updates(train, kind, params):
    """The trainer's lr per step against DeepSpeed's scheduler (optim/ds_schedules.py, itself
    tested against DeepSpeed's lr_schedules.py) stepped after each applied update."""
    ds = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "scheduler": {"type": kind, "params": params}}
    cfg = train(ds, args=["--max_steps", "30"])
    assert cfg.lr_schedule == {"WarmupLR": "deepspeed_warmup", "WarmupDecayLR": "deepspeed_warmup_decay",
                               "WarmupCosineLR": "deepspeed_warmup_cosine"}[kind]
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    ref, updates = ds_schedules.from_block(opt, {"type": kind, "params": params}, fill=HF_FILL), 0
    for step in range(30):
        ours = lr_at(position(cfg, step, updates), cfg)
        want = opt.param_groups[0]["lr"]
        assert math.isclose(ours, want, rel_tol=1e-12, abs_tol=1e-18), (step, ours, want)
        if step % 7 != 3:  # an fp16 overflow skips the update: neither schedule advances
            updates += 1
            ref.step()


@pytest.mark.parametrize("scheduler, key, why", [
    ({"type": "WarmupDecayLR", "params": {"warmup_type": "linear"}}, "scheduler.params.total_num_steps",
     "needs it"),
    ({"type": "WarmupLR", "params": {"warmup_type": "cubic"}}, "scheduler.params.warmup_type", "linear or log"),
    ({"type": "WarmupCosineLR", "params": {"warmup_type": "linear"}}, "scheduler.params.total_num_steps",
     "needs it"),
    ({"type": "WarmupLR", "params": {"total_num_steps": 10, "warmup_type": "linear"}},
     "scheduler.params.total_num_steps", "not a parameter of DeepSpeed's WarmupLR"),
    ({"type": "OneCycle", "params": {"cycle_min_lr": 1e-4}}, "scheduler.type", "zerompi.initialize runs"),
])
def test_schedules_that_cannot_map_exactly_are_refused_by_key(train, scheduler, key, why):
    with pytest.raises(ConfigError) as e:
        train({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "scheduler": scheduler})
    assert e.value.key == f"deepspeed_config.{key}" and why in e.value.why


def test_schedule_fields_are_checked():
    TrainConfig(lr_schedule="deepspeed_warmup", warmup_steps=2, min_lr=5.0)  # min_lr unused there
    for bad, key in (({"lr_schedule": "linear"}, "lr_schedule"), ({"lr_schedule": "deepspeed_warmup",
                     "warmup_steps": 1}, "warmup_steps"), ({"warmup_start_lr": -1.0}, "warmup_start_lr")):
        with pytest.raises(ConfigError) as e:
            TrainConfig(**bad)
        assert e.value.key == key
