"""DeepSpeed JSON configs read as DeepSpeed means them (zerompi/config/deepspeed/): every
key is mapped, ignored or refused by the one table (deepspeed/keys.py), with DeepSpeed's
defaults; unknown keys are named or refused; zerompi.initialize takes the file. The
trainer's side (--deepspeed_config): tests/unit/test_ds_train.py and
tests/system/test_train_deepspeed.py. Every config here is
written for these tests."""
import json
import warnings

import pytest
import torch

import zerompi
from zerompi.config import ConfigError
from zerompi.config.deepspeed import DeepSpeedConfigWarning, translate
from zerompi.config.deepspeed.keys import IGNORE, MAP, REFUSE, TABLE, markdown
from zerompi.config.deepspeed.zero import buffer_bytes

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
    t = translate(DS, world_size=2)
    cfg = zerompi.load_config(t.zero)
    assert (cfg.stage, cfg.precision, cfg.gradient_accumulation_steps, cfg.gradient_clipping) == (3, "bf16", 4, 1.0)
    assert (cfg.optimizer.lr, cfg.optimizer.betas, cfg.optimizer.eps, cfg.optimizer.weight_decay) == \
        (3e-4, (0.9, 0.95), 1e-7, 0.1)
    assert (cfg.stage3.prefetch_modules, cfg.stage3.persistence_threshold, cfg.stage3.max_live_parameters) == \
        (1, 10000, 10**9)
    # DeepSpeed reduces and accumulates in the parameters' dtype when the file does not say otherwise
    assert (cfg.reduce_dtype, cfg.grad_accum_dtype) == ("param", "param")
    # reduce_bucket_size 5e5 bf16 elements = 1,000,000 bytes in DeepSpeed (stage 3: one buffer);
    # zerompi's 2 slots x (2 + 1/2) buckets x 2 bytes fit in it at 100,000 elements
    assert cfg.bucket_size == 100_000 and buffer_bytes(cfg.bucket_size, 2, 2, 2) == 1_000_000
    assert t.trainer == {"global_batch": 16}
    ac = cfg.activation_checkpointing  # partition_activations -> Pa (activation_checkpointing.partition)
    assert (ac.enabled, ac.partition, ac.cpu_offload, ac.contiguous) == (True, True, False, False)
    # Named: what zerompi does not do; not named: what it always does, or what is switched off.
    assert sorted(t.ignored) == ["steps_per_print", "zero_optimization.allgather_bucket_size"]


def test_fp16_block_and_derived_accumulation():
    t = translate({"fp16": {"enabled": True, "initial_scale_power": 12, "loss_scale_window": 500,
                            "hysteresis": 3, "min_loss_scale": 0.5, "loss_scale": 0},
                   "train_batch_size": 24, "train_micro_batch_size_per_gpu": 4,
                   "zero_optimization": {"stage": 1, "stage3_prefetch_bucket_size": 0}}, world_size=3)
    cfg = zerompi.load_config(t.zero)
    assert cfg.precision == "fp16" and cfg.gradient_accumulation_steps == 2 and t.trainer == {"global_batch": 24}
    assert (cfg.fp16.initial_scale, cfg.fp16.window, cfg.fp16.hysteresis, cfg.fp16.min_scale) == (4096, 500, 3, 0.5)
    assert cfg.stage3.prefetch_modules == 0
    # a bare fp16 block means DeepSpeed's scaler, whatever zerompi's own defaults are
    cfg = zerompi.load_config({"fp16": {"enabled": True}, "zero_optimization": {"stage": 1}})
    assert (cfg.fp16.initial_scale, cfg.fp16.window, cfg.fp16.hysteresis, cfg.fp16.min_scale, cfg.fp16.factor) == \
        (2.0**16, 1000, 2, 1.0, 2.0)


def test_auto_keeps_the_runs_settings_and_says_so(capsys):
    """zerompi.initialize's run is zerompi's defaults: "auto" keeps them (the trainer's
    --config: tests/unit/test_ds_train.py)."""
    hf = {"bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"}, "train_batch_size": "auto",
          "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
          "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
          "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"}}
    cfg = zerompi.load_config(hf)
    dflt = zerompi.ZeroConfig()
    assert (cfg.precision, cfg.optimizer.lr, cfg.optimizer.weight_decay, cfg.gradient_clipping, cfg.bucket_size,
            cfg.gradient_accumulation_steps) == ("fp32", dflt.optimizer.lr, dflt.optimizer.weight_decay, 0.0, "auto", 1)
    assert cfg.optimizer.betas == (0.9, 0.999) and cfg.optimizer.eps == 1e-8  # not "auto": DeepSpeed's defaults
    err = capsys.readouterr().err
    assert err.count('"auto" keeps this run\'s own setting for 8 key(s): bf16.enabled, fp16.enabled') == 1, err


@pytest.mark.parametrize("ds, key", [
    ({"optimizer": {"type": "Adam", "params": {"bias_correction": False}}}, "optimizer.params.bias_correction"),
    ({"compression_training": {"weight_quantization": {"shared_parameters": {"enabled": True}}}},
     "compression_training"),
    ({"data_efficiency": {"enabled": True, "data_sampling": {"enabled": True}}}, "data_efficiency"),
    ({"progressive_layer_drop": {"enabled": True, "theta": 0.5}}, "progressive_layer_drop"),
    ({"quantize_training": {"enabled": True, "quantize_bits": {"start_bits": 16}}}, "quantize_training"),
    ({"zero_optimization": {"stage": 2, "zenflow": {"topk_ratio": 0.05}}}, "zero_optimization.zenflow"),
    ({"curriculum_learning": {"enabled": True, "curriculum_type": "seqlen"}}, "curriculum_learning"),
    ({"sparse_attention": {"mode": "fixed", "block": 16}}, "sparse_attention"),
    ({"zero_optimization": {"stage": 3, "zero_quantized_weights": True}}, "zero_optimization.zero_quantized_weights"),
    ({"gradient_allreduce_op": "sum"}, "gradient_allreduce_op"),
    ({"bfloat16": {"enabled": True, "bf16_master_weights_and_grads": True}}, "bfloat16.bf16_master_weights_and_grads"),
])
def test_keys_that_change_the_model_are_refused_by_name(ds, key):
    with pytest.raises(ConfigError) as e:
        zerompi.load_config({"train_micro_batch_size_per_gpu": 1, **ds})  # a DeepSpeed config by its keys
    assert e.value.key == key


def test_switched_off_features_need_no_mention():
    off = {"zero_optimization": {"stage": 1, "zenflow": None, "zero_quantized_weights": False},
           "compression_training": {"weight_quantization": {"shared_parameters": {"enabled": False}}},
           "data_efficiency": {"enabled": False}, "progressive_layer_drop": {"enabled": False},
           "curriculum_learning": {"enabled": False}, "quantize_training": {"enabled": False},
           "optimizer": {"type": "AdamW", "params": {"bias_correction": True}}, "sequence_parallel_size": 1,
           "fp16": {"enabled": False, "loss_scale": 128}, "amp": {"enabled": False, "opt_level": "O2"}}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert zerompi.load_config(off).stage == 1
    assert not [w for w in caught if issubclass(w.category, DeepSpeedConfigWarning)]


def _on(entry):
    """A value that switches the refused feature on, and the config it takes effect in."""
    value = {"optimizer.params.bias_correction": False, "optimizer.params.fp32_optimizer_states": False,
             "managed_gradient_accumulation": False, "fp16.loss_scale": 128, "gradient_allreduce_op": "sum",
             "sequence_parallel_size": 2, "tensor_parallel.autotp_size": 2, "zero_optimization.zenflow": {},
             "optimizer.params.max_grad_norm": 1.0}.get(entry.key, True if entry.default is False else {"enabled": True})
    ds: dict = {"optimizer": {"type": "AdamW"}, "zero_optimization": {"stage": 2}}
    block = entry.key.split(".")[0]
    if block in ("fp16", "bf16"):
        ds[block] = {"enabled": True}
    d = ds
    for part in entry.key.split(".")[:-1]:
        d = d.setdefault(part, {})
    d[entry.key.split(".")[-1]] = value
    return ds


@pytest.mark.parametrize("key", [k for k, e in TABLE.items() if e.action == REFUSE])
def test_every_refusal_in_the_table_names_its_key_and_why(key):
    with pytest.raises(ConfigError) as e:
        translate(_on(TABLE[key]), world_size=4)
    assert e.value.key == key and e.value.why == TABLE[key].what


def test_every_mapped_key_is_read_and_nothing_is_dropped():
    """The translator asserts that it read every mapped key it was given; these configs
    give every mapped key of the table between them."""
    common = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
              "gradient_clipping": 0.5, "communication_data_type": "fp32",
              "data_types": {"grad_accum_dtype": "fp32", "param_dtype": "fp16", "buffer_dtype": "fp16"},
              "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "betas": [0.8, 0.9], "eps": 1e-6,
                                                       "weight_decay": 0.0, "adam_w_mode": False,
                                                       "torch_adam": True}},
              "zero_optimization": {"stage": 3, "reduce_bucket_size": 10**6, "overlap_comm": True,
                                    "stage3_prefetch_bucket_size": 10**6, "stage3_param_persistence_threshold": 10,
                                    "stage3_max_live_parameters": 10**8,
                                    "zero_hpz_partition_size": 2, "mics_shard_size": 2},
              "activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": True,
                                           "contiguous_memory_optimization": True}}
    fp16 = dict(common, fp16={"enabled": True, "initial_scale_power": 8, "loss_scale_window": 10, "hysteresis": 1,
                              "min_loss_scale": 1}, bf16={"enabled": False})
    offload = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    old_offload = {"zero_optimization": {"stage": 2, "cpu_offload": True}}
    warmup = {"scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-3,
                                                           "warmup_num_steps": 3, "warmup_type": "linear",
                                                           "last_batch_iteration": -1}}}
    cosine = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "scheduler": {
        "type": "WarmupCosineLR", "params": {"total_num_steps": 10, "warmup_min_ratio": 0.1, "cos_min_ratio": 0.1,
                                             "warmup_num_steps": 3, "warmup_type": "linear"}}}

    def keys(d, prefix=""):
        for k, v in d.items():
            yield from keys(v, f"{prefix}{k}.") if isinstance(v, dict) and f"{prefix}{k}" not in TABLE else \
                [f"{prefix}{k}"]

    one_cycle = {"scheduler": {"type": "OneCycle", "params": {  # zerompi.initialize's (optim/ds_schedules.py)
        "cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "decay_lr_rate": 0.1, "cycle_first_step_size": 4,
        "cycle_second_step_size": 3, "cycle_first_stair_count": 1, "cycle_second_stair_count": 1,
        "decay_step_size": 2, "cycle_momentum": True, "cycle_min_mom": 0.8, "cycle_max_mom": 0.9,
        "decay_mom_rate": 0.1, "last_batch_iteration": -1}}}
    sgd = {"optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9, "dampening": 0.0, "nesterov": True}}}
    adagrad = {"optimizer": {"type": "Adagrad", "params": {"lr_decay": 0.1, "initial_accumulator_value": 0.1}}}
    given = set()
    for ds in (fp16, offload, old_offload, warmup, cosine, one_cycle, sgd, adagrad):
        translate(ds, world_size=2, trainer=ds not in (one_cycle, sgd, adagrad))
        given |= set(keys(ds))
    assert {k for k, e in TABLE.items() if e.action == MAP} <= given


def test_unknown_keys_are_named_at_the_top_and_refused_inside_blocks():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        zerompi.load_config({"zero_optimization": {"stage": 1}, "my_launcher_flag": 3, "steps_per_print": 5})
    msg = [str(w.message) for w in caught if issubclass(w.category, DeepSpeedConfigWarning)]
    assert len(msg) == 1 and "unknown to zerompi, not used" in msg[0] and "my_launcher_flag" in msg[0]
    for ds, key in (({"zero_optimization": {"stage": 2, "reduce_bucket_sizes": 5}},
                     "zero_optimization.reduce_bucket_sizes"),
                    ({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "momentum": 0.9}}},
                     "optimizer.params.momentum"),
                    ({"fp16": {"enabled": True, "loss_scale_windw": 100}}, "fp16.loss_scale_windw")):
        with pytest.raises(ConfigError) as e:
            zerompi.load_config(ds)
        assert e.value.key == key


@pytest.mark.parametrize("ds, key, why", [
    # DeepSpeed's arithmetic with Ulysses: 2 = micro 2 x accumulation 2 x (1 rank / 2)
    ({"sequence_parallel_size": 2, "train_batch_size": 2, "train_micro_batch_size_per_gpu": 2,
      "gradient_accumulation_steps": 2}, "sequence_parallel_size", "sequence parallelism"),
    ({"zero_optimization": {"stage": 2, "reduce_bucket_size": 0}}, "zero_optimization.reduce_bucket_size", ">= 1"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}},
     "zero_optimization.offload_optimizer.device", "cpu only"),
    ({"zero_optimization": {"stage": 2, "cpu_offload": True, "offload_optimizer": {"device": "cpu"}}},
     "zero_optimization.cpu_offload", "together"),
    ({"optimizer": {"type": "Lamb", "params": {"lr": 1e-3, "max_coeff": 0.3}}}, "optimizer.type", "LAMB"),
    ({"optimizer": {"type": "SGD", "params": {"lr": 1e-3, "betas": [0.9, 0.9]}}}, "optimizer.params.betas",
     "not a parameter of torch.optim.SGD"),
    ({"optimizer": {"type": "Adam", "params": {"adam_w_mode": False, "weight_decay": 0.1}}},
     "optimizer.params.adam_w_mode", "L2"),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "bf16.enabled", "both"),
    ({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2},
     "train_batch_size", "DeepSpeed requires"),
    ({"train_batch_size": 10, "gradient_accumulation_steps": 3}, "train_batch_size", "(derived)"),
    ({"scheduler": {"type": "OneCycle", "params": {"warmup_num_steps": 3}}}, "scheduler.params.warmup_num_steps",
     "not a parameter of DeepSpeed's OneCycle"),
])
def test_refusals_name_the_key_as_written_and_the_true_reason(ds, key, why):
    with pytest.raises(ConfigError) as e:
        zerompi.load_config(ds)  # one rank: this process
    assert e.value.key == key and why in e.value.why


def test_the_batch_is_split_over_the_data_parallel_ranks():
    # initialize(model, ds, dims=dp 2 x tp 2): DeepSpeed divides by the data-parallel ranks
    ds = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2}
    assert zerompi.load_config(ds, dp_size=2).gradient_accumulation_steps == 4
    assert zerompi.load_config(ds, dp_size=4).gradient_accumulation_steps == 2


def test_cpu_offload_is_the_older_spelling_of_optimizer_offload():
    assert zerompi.load_config({"zero_optimization": {"stage": 2, "cpu_offload": True}}).offload_optimizer == "cpu"
    t = translate({"zero_optimization": {"stage": 2, "offload_optimizer": {
        "device": "cpu", "pin_memory": True, "buffer_count": 4}}}, world_size=2)
    assert zerompi.load_config(t.zero).offload_optimizer == "cpu"
    assert sorted(t.ignored) == ["zero_optimization.offload_optimizer.buffer_count",
                                 "zero_optimization.offload_optimizer.pin_memory"]


@pytest.mark.parametrize("stage, extra, ds_bytes", [
    (2, {}, 5 * 10**8 * 2),                                    # one bf16 buffer
    (2, {"overlap_comm": True}, 2 * 5 * 10**8 * 2),            # double-buffered at stages 1-2
    (3, {"overlap_comm": True}, 5 * 10**8 * 2),                # stage 3: one
])
@pytest.mark.parametrize("comm", [None, "fp32"])
def test_reduce_bucket_size_costs_no_more_than_deepspeeds_buffers(stage, extra, ds_bytes, comm):
    """The engine's reducer buffers (estimate/activations.comm_buffer_bytes, equal to
    memory_report()["buffers"]) for a 7.5B-element layout at N = 8 in bf16."""
    from zerompi.estimate.activations import comm_buffer_bytes
    from zerompi.zero.partition import FlatLayout

    ds = {"bf16": {"enabled": True}, "zero_optimization": {"stage": stage, "reduce_bucket_size": 5e8, **extra}}
    if comm:
        ds["communication_data_type"] = comm
    cfg = zerompi.load_config(ds, dp_size=8)
    layout = FlatLayout([7_500_000_000], world=8, block=cfg.bucket_size, align=cfg.alignment)
    used = comm_buffer_bytes(layout, cfg.bucket_count, 4 if comm else 2)
    assert 0.98 * ds_bytes < used <= ds_bytes, (cfg.bucket_size, used)


def test_initialize_takes_a_deepspeed_file_with_one_warning_and_says_what_is_in_effect(tmp_path, capsys):
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
    err = capsys.readouterr().err
    assert (f"zerompi: DeepSpeed config {path}, in effect: optimizer AdamW lr 0.0003, betas (0.9, 0.95), eps 1e-07, "
            "weight_decay 0.1, bias-corrected, decoupled; schedule none") in err, err
    assert "precision bf16 (gradients reduced in bf16, accumulated in bf16); clipping at global L2 norm 1; " \
        "batch 8 = micro 2 x accumulation 4 x 1 data-parallel ranks" in err, err
    assert engine.config.stage == 2 and engine.config.precision == "bf16"
    assert engine.gradient_accumulation_steps == 4
    # The same engine as from the equivalent zerompi dict: one update gives equal weights.
    ref_engine = zerompi.initialize(ref, translate(ds, world_size=1).zero)
    x = torch.randn(4, 8)
    for eng in (engine, ref_engine):
        for _ in range(4):
            eng.backward(eng(x).float().pow(2).mean())
            eng.step()
    a, b = engine.full_state_dict(), ref_engine.full_state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_docs_key_table_is_the_table():
    doc = (__import__("pathlib").Path(__file__).parents[2] / "docs" / "migrating-from-deepspeed.md").read_text()
    begin = "<!-- deepspeed-keys:begin (generated: python -m zerompi.config.deepspeed.keys) -->\n"
    assert doc[doc.index(begin) + len(begin):doc.index("<!-- deepspeed-keys:end -->")] == markdown(), \
        "regenerate the table: python -m zerompi.config.deepspeed.keys"
    from zerompi.config.deepspeed.report import RULE

    assert f"`zerompi.train: which side wins: {RULE}`" in " ".join(doc.split())  # the rule printed is the rule documented
    for key, e in TABLE.items():  # every key in its section, with its reason
        assert f"| `{key}`" in markdown() and (e.action != IGNORE or e.what.replace("|", "/") in markdown())
