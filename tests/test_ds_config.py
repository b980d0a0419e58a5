"""DeepSpeed JSON configs (zerompi/config/deepspeed.py): every supported key maps onto our
config, every ignored key is named in one warning, keys whose absence would change the
math are errors; zerompi.initialize and `zerompi.train --deepspeed_config` take the file."""
import json
import warnings

import pytest
import torch

import zerompi
from mpirun import run_mpi
from zerompi.config import ConfigError
from zerompi.config.deepspeed import DeepSpeedConfigWarning, translate

DS = {
    "train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
    "gradient_clipping": 1.0, "steps_per_print": 10, "wall_clock_breakdown": False,
    "bf16": {"enabled": True},
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-7,
                                              "weight_decay": 0.1, "torch_adam": True}},
    "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True,
                          "reduce_bucket_size": 5e5, "allgather_bucket_size": 5e8,
                          "stage3_prefetch_bucket_size": 5e7, "stage3_param_persistence_threshold": 1e4,
                          "stage3_max_live_parameters": 1e9, "offload_optimizer": {"device": "none"}},
    "activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": False},
}


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


def test_train_cli_takes_deepspeed_config(tmp_path):
    from zerompi.data import default_corpus

    corpus = default_corpus(tmp_path / "cache", max_bytes=100_000)
    (tmp_path / "ds.json").write_text(json.dumps(dict(DS, zero_optimization={"stage": 2})))
    run = tmp_path / "run"
    res = run_mpi(2, ["-m", "zerompi.train", "--deepspeed_config", str(tmp_path / "ds.json"), "--data", str(corpus),
                      "--model.preset", "tiny", "--max_steps", "2", "--eval_interval", "0", "--threads", "1",
                      "--progress", "lines", "--run_dir", str(run)], module=False, timeout=90)
    assert res.stdout.count("zerompi.train: warning: DeepSpeed config") == 1, res.stdout
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["global_batch"] == 16 and cfg["zero"]["stage"] == 2 and cfg["zero"]["precision"] == "bf16"
    assert cfg["zero"]["gradient_accumulation_steps"] == 4 and cfg["zero"]["optimizer"]["lr"] == 3e-4
    (tmp_path / "sched.json").write_text(json.dumps({"scheduler": {"type": "WarmupLR"}}))
    bad = run_mpi(2, ["-m", "zerompi.train", "--deepspeed_config", str(tmp_path / "sched.json"), "--data",
                      str(corpus), "--run_dir", str(tmp_path / "bad")], module=False, timeout=60, check=False)
    assert bad.returncode == 2 and bad.stdout.count("deepspeed_config.scheduler.type") == 1, bad.stdout


def test_offload_optimizer_to_cpu_maps_and_nvme_is_refused():
    zero, _, ignored = translate({"zero_optimization": {"stage": 2, "offload_optimizer": {
        "device": "cpu", "pin_memory": True, "buffer_count": 4}}}, world_size=2)
    assert zerompi.load_config(zero).offload_optimizer == "cpu"
    assert sorted(ignored) == ["zero_optimization.offload_optimizer.buffer_count",
                               "zero_optimization.offload_optimizer.pin_memory"]
    with pytest.raises(ConfigError, match="zero_optimization.offload_optimizer.device"):
        translate({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}}, world_size=2)
