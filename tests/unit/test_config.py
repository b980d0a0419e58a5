"""zerompi.config: defaults, sources (dict/JSON/TOML/config), overrides, validation."""
from __future__ import annotations

import dataclasses
import json

import pytest

from zerompi import config as C
from zerompi.trainer import config as train_config
from zerompi.config import ZeroConfig, load, parse_overrides, to_dict
from zerompi.trainer.config import ModelConfig, TrainConfig


def test_defaults():
    cfg = load()
    assert cfg == ZeroConfig()
    assert cfg.stage == 0 and cfg.precision == "fp32" and cfg.alignment == 16
    assert cfg.optimizer.lr == 1e-3 and cfg.optimizer.betas == (0.9, 0.999)
    assert cfg.comm.reduce_scatter == "ordered" and cfg.comm.backend == "auto"
    assert cfg.gradient_clipping == 0.0 and cfg.gradient_accumulation_steps == 1
    assert load({}) == cfg and load(None, {}) == cfg and load(None, []) == cfg


def test_dict_source():
    cfg = load({"stage": 2, "precision": "bf16", "optimizer": {"lr": 3e-4, "betas": [0.9, 0.95]},
                "comm": {"reduce_scatter": "native"}})
    assert cfg.stage == 2 and cfg.precision == "bf16"
    assert cfg.optimizer.lr == 3e-4 and cfg.optimizer.betas == (0.9, 0.95)
    assert cfg.optimizer.eps == 1e-8  # untouched nested fields keep their defaults
    assert cfg.comm.reduce_scatter == "native"


def test_config_source_roundtrip():
    cfg = load({"stage": 3, "optimizer": {"betas": (0.8, 0.9)}})
    assert load(cfg) == cfg
    assert load(to_dict(cfg)) == cfg
    assert load(cfg, ["optimizer.lr=0.5"]).optimizer == dataclasses.replace(cfg.optimizer, lr=0.5)


def test_dict_with_section_objects():
    # a dict may carry ready-made section configs; overrides still apply inside them
    opt = C.OptimizerConfig(lr=0.5, betas=(0.8, 0.9))
    cfg = load({"stage": 1, "optimizer": opt}, ["optimizer.eps=1e-6"])
    assert cfg.optimizer == dataclasses.replace(opt, eps=1e-6)


def test_json_file(tmp_path):
    p = tmp_path / "c.json"
    p.write_text(json.dumps({"stage": 1, "bucket_size": 1000, "fp16": {"window": 50}}))
    cfg = load(p)
    assert cfg.stage == 1 and cfg.bucket_size == 1000 and cfg.fp16.window == 50
    assert load(str(p)) == cfg


def test_toml_file(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text('stage = 2\nprecision = "bf16"\ngradient_clipping = 1.0\n\n'
                 '[optimizer]\nlr = 3e-4\nbetas = [0.9, 0.95]\n\n[stage3]\nprefetch_modules = 0\n')
    cfg = load(p)
    assert cfg.stage == 2 and cfg.precision == "bf16" and cfg.gradient_clipping == 1.0
    assert cfg.optimizer.lr == 3e-4 and cfg.optimizer.betas == (0.9, 0.95)
    assert cfg.stage3.prefetch_modules == 0


def test_overrides_both_forms():
    assert parse_overrides(["optimizer.lr=3e-4", "--stage", "2", "--precision=bf16"]) == {
        "optimizer.lr": "3e-4", "stage": "2", "precision": "bf16"}
    a = load(None, ["optimizer.lr=3e-4"])
    b = load(None, ["--optimizer.lr", "3e-4"])
    assert a == b and a.optimizer.lr == 3e-4
    assert load(None, ["--stage=2"]).stage == 2
    assert load(None, {"stage": 2}).stage == 2
    # dashes in CLI names map to underscores
    assert load(None, ["--gradient-accumulation-steps", "4"]).gradient_accumulation_steps == 4
    with pytest.raises(ValueError):
        parse_overrides(["stage"])  # neither key=value nor --key value


def test_overrides_apply_on_top_of_file(tmp_path):
    p = tmp_path / "c.json"
    p.write_text(json.dumps({"stage": 1, "optimizer": {"lr": 1.0, "eps": 1e-6}}))
    cfg = load(p, ["--stage=2", "optimizer.lr=0.25"])
    assert cfg.stage == 2 and cfg.optimizer.lr == 0.25 and cfg.optimizer.eps == 1e-6


def test_betas_from_string():
    assert load(None, ["optimizer.betas=0.9,0.95"]).optimizer.betas == (0.9, 0.95)
    assert load(None, ["--optimizer.betas", "(0.8, 0.99)"]).optimizer.betas == (0.8, 0.99)
    assert isinstance(load(None, ["optimizer.betas=0.9,0.95"]).optimizer.betas, tuple)


def _raises_naming(key: str, value: str, source=None, overrides=None):
    with pytest.raises(ValueError) as e:
        load(source, overrides)
    msg = str(e.value)
    assert key in msg and value in msg, msg
    return msg


@pytest.mark.parametrize("overrides,key,value", [
    (["foo=1"], "'foo'", "1"),
    (["optimizer.lrr=0.1"], "'optimizer.lrr'", "0.1"),
    (["--comm.algo", "x"], "'comm.algo'", "x"),
])
def test_unknown_keys(overrides, key, value):
    msg = _raises_naming(key, value, overrides=overrides)
    assert "unknown" in msg


def test_unknown_keys_in_dict_and_file(tmp_path):
    _raises_naming("'optimizer.lrr'", "0.1", source={"optimizer": {"lrr": 0.1}})
    p = tmp_path / "c.toml"
    p.write_text("stages = 2\n")
    _raises_naming("'stages'", "2", source=p)


@pytest.mark.parametrize("overrides,key,value", [
    (["stage=5"], "'stage'", "5"),
    (["--stage", "two"], "'stage'", "two"),
    (["stage=2.5"], "'stage'", "2.5"),
    (["precision=fp8"], "'precision'", "fp8"),
    (["gradient_clipping=-1"], "'gradient_clipping'", "-1"),
    (["gradient_clipping=abc"], "'gradient_clipping'", "abc"),
    (["bucket_size=0"], "'bucket_size'", "0"),
    (["alignment=3"], "'alignment'", "3"),
    (["alignment=0"], "'alignment'", "0"),
    (["optimizer.betas=0.9,1.0"], "'optimizer.betas'", "1.0"),
    (["optimizer.betas=-0.1,0.9"], "'optimizer.betas'", "-0.1"),
    (["optimizer.betas=0.9"], "'optimizer.betas'", "0.9"),
    (["optimizer.lr=-1e-3"], "'optimizer.lr'", "-0.001"),
    (["optimizer.eps=0"], "'optimizer.eps'", "0"),
    (["comm.reduce_scatter=tree"], "'comm.reduce_scatter'", "tree"),
    (["fp16.factor=1"], "'fp16.factor'", "1"),
    (["stage3.prefetch_modules=-1"], "'stage3.prefetch_modules'", "-1"),
    (["gradient_accumulation_steps=0"], "'gradient_accumulation_steps'", "0"),
])
def test_bad_values(overrides, key, value):
    _raises_naming(key, value, overrides=overrides)


def test_bad_values_typed_sources():
    _raises_naming("'stage'", "'two'", source={"stage": "two"})
    _raises_naming("'stage'", "True", source={"stage": True})
    _raises_naming("'precision'", "16", source={"precision": 16})
    _raises_naming("'optimizer'", "3", source={"optimizer": 3})
    with pytest.raises(ValueError, match="'stage' = 5"):
        ZeroConfig(stage=5)  # direct construction validates too


def test_missing_file(tmp_path):
    p = tmp_path / "nope.toml"
    with pytest.raises(ValueError) as e:
        load(p)
    assert str(p) in str(e.value)


@pytest.mark.parametrize("name,text", [("bad.json", '{"stage": 2,'), ("bad.toml", "stage = = 2\n"),
                                       ("bad.json", "stage = 2\n")])
def test_malformed_file(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    with pytest.raises(ValueError) as e:
        load(p)
    assert str(p) in str(e.value)


def test_frozen():
    cfg = load()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.stage = 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.optimizer.lr = 1.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.comm.reduce_scatter = "native"
    assert hash(cfg) == hash(load())  # frozen + hashable: usable as a cache key


def test_precisions_constant():
    for p in C.PRECISIONS:
        assert load(None, [f"precision={p}"]).precision == p


# ---------------------------------------------------------------- sections, nesting, round trips


@pytest.mark.parametrize("overrides,key,value", [
    (["zero.optimizer.lr=-1"], "'zero.optimizer.lr'", "-1.0"),
    (["--zero.fp16.window", "0"], "'zero.fp16.window'", "0"),
    (["model.n_head=3"], "'model.n_head'", "3"),  # tiny's n_embd 64 is not divisible by 3
    (["zero.stage=7"], "'zero.stage'", "7"),
])
def test_train_config_names_the_full_dotted_key(overrides, key, value):
    with pytest.raises(C.ConfigError) as e:
        train_config.load(None, overrides)
    assert str(e.value).startswith(f"config key {key} = {value}: "), str(e.value)


@pytest.mark.parametrize("argv,needle", [
    (["--zero.stag", "2"], "config key 'zero.stag' = '2': unknown key"),
    (["--max_step", "3"], "config key 'max_step' = '3': unknown key"),
    (["--global_batch", "lots"], "config key 'global_batch' = 'lots': expected an integer"),
    (["--block_size", "65"], "config key 'block_size' = 65: must be <= the model's context length 64"),
])
def test_train_command_line_names_the_key_as_typed(argv, needle):
    """`python -m zerompi.train` parses its arguments with from_argv; the job's one line on
    rank 0 and exit 2: tests/system/test_train.py."""
    with pytest.raises(C.ConfigError) as e:
        train_config.from_argv(["--model.preset", "tiny"] + argv)
    assert str(e.value).startswith(needle), str(e.value)


def test_train_config_nested_in_a_file(tmp_path):
    p = tmp_path / "t.toml"
    p.write_text("max_steps = 5\n[zero.optimizer]\nlr = -1\n")
    with pytest.raises(ValueError, match=r"^config key 'zero\.optimizer\.lr' = -1\.0: must be >= 0$"):
        train_config.load(p)


def test_tensor_parallel_size_is_validated_naming_the_key():
    assert ZeroConfig(tensor_parallel_size=2).tensor_parallel_size == 2
    with pytest.raises(C.ConfigError, match=r"^config key 'tensor_parallel_size' = 0: must be >= 1"):
        ZeroConfig(tensor_parallel_size=0)
    with pytest.raises(C.ConfigError, match=r"^config key 'zero\.tensor_parallel_size' = -2: "):
        C.load({"zero": {"tensor_parallel_size": -2}}, cls=TrainConfig)


@pytest.mark.parametrize("make,key", [
    (lambda: C.OptimizerConfig(lr=-1), "'lr' = -1"),
    (lambda: C.LossScaleConfig(window=0), "'window' = 0"),
    (lambda: C.CommConfig(backend="gloo"), "'backend' = 'gloo'"),
    (lambda: C.Stage3Config(prefetch_modules=-1), "'prefetch_modules' = -1"),
])
def test_sections_validate_on_construction(make, key):
    with pytest.raises(C.ConfigError) as e:
        make()
    assert isinstance(e.value, ValueError)  # callers catching ValueError keep working
    assert str(e.value).startswith(f"config key {key}: "), str(e.value)


def test_to_dict_round_trips_every_config():
    zero = load({"stage": 3, "precision": "bf16", "optimizer": {"lr": 3e-4, "betas": [0.8, 0.95]},
                 "fp16": {"window": 50}, "comm": {"reduce_scatter": "native"}})
    train = TrainConfig(model=ModelConfig(preset="small", n_layer=2), max_steps=7, zero=zero)
    for cfg in (ZeroConfig(), zero, TrainConfig(), train):
        d = to_dict(cfg)
        assert load(d, cls=type(cfg)) == cfg
        assert load(json.loads(json.dumps(d)), cls=type(cfg)) == cfg  # as written to config.json
    assert to_dict(train)["zero"]["optimizer"]["betas"] == (0.8, 0.95)
