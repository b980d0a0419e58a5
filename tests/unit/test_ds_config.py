"""DeepSpeed JSON configs (zerompi/config/deepspeed.py): every supported key maps onto our
config, every ignored key is named in one warning, keys whose absence would change the
math are errors; zerompi.initialize takes the file (the trainer's --deepspeed_config:
tests/system/test_train_deepspeed.py)."""
import json
import warnings

import pytest
import torch

import zerompi
from ds_example import DS
from zerompi.config import ConfigError
from zerompi.config.deepspeed import DeepSpeedConfigWarning, translate


def test_supported_keys_map_onto_zero_config():
    zero, trainer, ignored = translate(DS, world_size=2)
    cfg = zerompi.load_config(zero)
    assert (cfg.stage, cfg.precision, cfg.gradient_accumulation_steps, cfg.gradient_clipping) == (3, "bf16", 4, 1.0)
    assert cfg.bucket_size == 500000
    assert (cfg.optimizer.lr, cfg.optimizer.betas, cfg.optimizer.eps, cfg.optimizer.weight_decay) == \
        (3e-4, (0.9, 0.95), 1e-7, 0.1)
    assert (cfg.stage3.prefetch_modules, cfg.stage3.persistence_threshold, cfg.stage3.max_live_parameters) == \
        (1, 10000, 10**9)
    assert trainer == {"global_batch": 16}
    ac = cfg.activation_checkpointing  # partition_activations -> Pa (activation_checkpointing.partition)
    assert (ac.enabled, ac.partition, ac.cpu_offload, ac.contiguous) == (True, True, False, False)
    # Named: what zerompi does not do; not named: what it always does, or what is switched off.
    assert sorted(ignored) == sorted(["optimizer.params.torch_adam", "zero_optimization.allgather_bucket_size",
                                      "steps_per_print"])


def test_fp16_block_and_derived_accumulation():
    zero, trainer, _ = translate({"fp16": {"enabled": True, "initial_scale_power": 12, "loss_scale_window": 500,
                                           "hysteresis": 3, "min_loss_scale": 0.5, "loss_scale": 0},
                                  "train_batch_size": 24, "train_micro_batch_size_per_gpu": 4,
                                  "zero_optimization": {"stage": 1, "stage3_prefetch_bucket_size": 0}},
                                 world_size=3)
    cfg = zerompi.load_config(zero)
    assert cfg.precision == "fp16" and cfg.gradient_accumulation_steps == 2 and trainer == {"global_batch": 24}
    assert (cfg.fp16.initial_scale, cfg.fp16.window, cfg.fp16.hysteresis, cfg.fp16.min_scale) == (4096, 500, 3, 0.5)
    assert cfg.stage3.prefetch_modules == 0
    # transformers' integration writes "auto": left to the defaults
    zero, trainer, ignored = translate({"train_batch_size": "auto", "gradient_accumulation_steps": "auto",
                                        "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"}},
                                       world_size=2)
    assert zero == {"precision": "fp32", "stage": 2} and trainer == {} and ignored == []


@pytest.mark.parametrize("ds, key", [
    ({"scheduler": {"type": "WarmupLR", "params": {}}}, "scheduler.type"),
    ({"optimizer": {"type": "Lamb", "params": {"lr": 1e-3}}}, "optimizer.type"),
    ({"optimizer": {"type": "Adam", "params": {"adam_w_mode": False, "weight_decay": 0.1}}},
     "optimizer.params.adam_w_mode"),
    ({"fp16": {"enabled": True, "loss_scale": 128}}, "fp16.loss_scale"),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "bf16.enabled"),
    ({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2},
     "train_batch_size"),
    ({"amp": {"enabled": True}}, "amp.enabled"),
])
def test_keys_that_change_the_math_are_errors(ds, key):
    with pytest.raises(ConfigError) as e:
        translate(ds, world_size=2)
    assert e.value.key == key


def test_initialize_takes_a_deepspeed_file_with_one_warning(tmp_path):
    path = tmp_path / "ds_config.json"
    ds = dict(DS, train_batch_size=8, train_micro_batch_size_per_gpu=2, zero_optimization=dict(
        DS["zero_optimization"], stage=2))
    path.write_text(json.dumps(ds))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    ref.load_state_dict(model.state_dict())  # before the engine casts to bf16
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = zerompi.initialize(model, str(path))
    ours = [w for w in caught if issubclass(w.category, DeepSpeedConfigWarning)]
    assert len(ours) == 1 and "steps_per_print" in str(ours[0].message)
    assert engine.config.stage == 2 and engine.config.precision == "bf16"
    assert engine.gradient_accumulation_steps == 4
    # The same engine as from the equivalent zerompi dict: one update gives equal weights.
    ref_engine = zerompi.initialize(ref, translate(ds, world_size=1)[0])
    x = torch.randn(4, 8)
    for eng in (engine, ref_engine):
        for _ in range(4):
            eng.backward(eng(x).float().pow(2).mean())
            eng.step()
    a, b = engine.full_state_dict(), ref_engine.full_state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_offload_optimizer_to_cpu_maps_and_nvme_is_refused():
    zero, _, ignored = translate({"zero_optimization": {"stage": 2, "offload_optimizer": {
        "device": "cpu", "pin_memory": True, "buffer_count": 4}}}, world_size=2)
    assert zerompi.load_config(zero).offload_optimizer == "cpu"
    assert sorted(ignored) == ["zero_optimization.offload_optimizer.buffer_count",
                               "zero_optimization.offload_optimizer.pin_memory"]
    with pytest.raises(ConfigError, match="zero_optimization.offload_optimizer.device"):
        translate({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}}, world_size=2)
