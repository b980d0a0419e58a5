"""The trainer's `model` table for both families (trainer/model_config.py), init_from's
shape, and the architecture record checkpoints keep (models/arch.py)."""
import json

import pytest

from zerompi.config.errors import ConfigError
from zerompi.models import arch
from zerompi.models.gpt_config import GPTConfig
from zerompi.models.gpt_config import PRESETS as GPT_PRESETS
from zerompi.models.llama_config import PRESETS as LLAMA_PRESETS
from zerompi.models.llama_config import LlamaConfig, to_hf
from zerompi.trainer.preflight import compare
from zerompi.trainer.config import ModelConfig, TrainConfig


def test_families_presets_and_reshaping():
    assert ModelConfig().shape() == GPT_PRESETS["tiny"] and ModelConfig().kind == "gpt"
    m = ModelConfig(family="llama", preset="llama3-8b", n_layer=2, n_kv_head=4)
    assert m.shape() == LlamaConfig(**{**vars(LLAMA_PRESETS["llama3-8b"]), "n_layer": 2, "n_kv_head": 4})
    small = ModelConfig(family="llama", n_head=2, n_embd=32).shape()
    assert small.head_dim == 16 and small.n_kv_head == 2  # recomputed from the new width
    with pytest.raises(ConfigError, match="'preset' = 'gpt2'.*llama3-8b"):
        ModelConfig(family="llama", preset="gpt2")
    with pytest.raises(ConfigError, match="'n_kv_head'.*llama family only"):
        ModelConfig(n_kv_head=2)
    with pytest.raises(ConfigError, match="'dropout'.*llama"):
        ModelConfig(family="llama", dropout=0.1)
    with pytest.raises(ConfigError, match="'n_kv_head'"):
        ModelConfig(family="llama", n_kv_head=3)
    with pytest.raises(ConfigError, match="'family' = 'bert'"):
        ModelConfig(family="bert")


def test_hf_config_and_init_from(tmp_path):
    shape = LlamaConfig(vocab_size=300, block_size=48, n_layer=1, n_head=4, n_kv_head=1, n_embd=32,
                        intermediate_size=40, tie_word_embeddings=True)
    (tmp_path / "config.json").write_text(json.dumps(to_hf(shape)))
    m = ModelConfig(config=str(tmp_path))
    assert m.kind == "llama" and m.shape() == shape
    with pytest.raises(ConfigError, match="'family' = 'gpt'.*is a llama model"):
        ModelConfig(family="gpt", config=str(tmp_path / "config.json"))
    with pytest.raises(ConfigError, match="'config' = .*nowhere"):
        ModelConfig(config=str(tmp_path / "nowhere"))
    t = TrainConfig(init_from=str(tmp_path), eval_interval=0)
    assert t.model.config == str(tmp_path) and t.model.shape() == shape and t.seq_len == 48
    with pytest.raises(ConfigError, match="'init_from'"):
        TrainConfig(init_from=str(tmp_path / "empty"))
    with pytest.raises(ConfigError, match="'tokenizer'"):
        TrainConfig(tokenizer=str(tmp_path / "tok.json"))
    with pytest.raises(ConfigError, match="block_size"):
        TrainConfig(init_from=str(tmp_path), block_size=64)


def test_architecture_record_round_trip_and_resume_comparison():
    gpt, llama = GPT_PRESETS["tiny"], LLAMA_PRESETS["llama3.1-8b"]
    for shape in (gpt, llama):
        rec = json.loads(json.dumps(arch.record(shape)))  # as a checkpoint stores it
        assert arch.shape_of(rec) == shape
        assert compare(rec, arch.record(shape), arch.ARCHITECTURE) == []
    diff = compare(arch.record(gpt), arch.record(LLAMA_PRESETS["tiny"]), arch.ARCHITECTURE)
    assert ("family", "gpt", "llama") in diff
    old = {k: getattr(gpt, k) for k in ("n_layer", "n_head", "n_embd", "vocab_size", "block_size", "bias")}
    assert compare(old, arch.record(gpt), arch.ARCHITECTURE) == []  # checkpoints before the llama family
    assert arch.shape_of(old) == GPTConfig(**old)
    assert arch.flops_per_token(gpt, 64) == 6 * 120576 - 6 * 64 * 64 + 12 * 2 * 64 * 64


def test_export_help_names_hf_and_the_real_checksums(capsys):
    from zerompi import export
    from zerompi.export_hf import parse_size

    with pytest.raises(SystemExit):
        export.main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--hf DIR" in out and "from_pretrained" in out
    assert "CRC-32 per 64 MiB block" in out and "skip the sha256 pass" not in out
    with pytest.raises(SystemExit):
        export.main(["ckpt"])  # neither OUT nor --hf
    assert "give either OUT or --hf DIR" in capsys.readouterr().err
    assert parse_size("5GB") == 5 << 30 and parse_size("40KB") == 40 << 10 and parse_size("512MiB") == 512 << 20


def test_resume_names_another_family_before_loading(monkeypatch):
    from zerompi.checkpoint import resume as resume_mod
    from zerompi.checkpoint import verify
    from zerompi.checkpoint.resume import ResumeError
    from zerompi.trainer.preflight import check_architecture_first

    class World:
        rank = 0

        def bcast_object(self, obj, root=0):
            return obj

    saved = {"client_state": {"model": arch.record(LLAMA_PRESETS["tiny"])}}
    monkeypatch.setattr(resume_mod, "candidates", lambda d, r: (["ckpt/step_0000004"], []))
    monkeypatch.setattr(verify, "read_manifest", lambda path: saved)
    with pytest.raises(ResumeError, match=r"model family: checkpoint 'llama', config 'gpt'; use|"
                                          r"model family: checkpoint 'llama', config 'gpt' \(same"):
        check_architecture_first(World(), "ckpt", "", arch.record(GPT_PRESETS["tiny"]))
    check_architecture_first(World(), "ckpt", "", arch.record(LLAMA_PRESETS["tiny"]))  # same: nothing
    reshaped = arch.record(LLAMA_PRESETS["small"])
    with pytest.raises(ResumeError, match="model n_layer: checkpoint 2, config 4"):
        check_architecture_first(World(), "ckpt", "", reshaped)
