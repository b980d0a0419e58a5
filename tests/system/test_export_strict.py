"""An exported checkpoint loads with strict=True into the model that was trained: plain
torch (model.pt, safetensors) for the trainer's GPT, and transformers' GPT-2, whose
lm_head is tied to the embedding (issue 16: the tied name used to be missing)."""
import subprocess
import sys

import pytest
import torch

from mpirun import mpi_env, run_mpi, run_worker


def _export(ckpt, out, *extra):
    p = subprocess.run([sys.executable, "-m", "zerompi.export", str(ckpt), str(out), *extra],
                       capture_output=True, text=True, env=mpi_env(), timeout=120)
    assert p.returncode == 0, p.stderr
    return p.stdout


def test_trainer_checkpoint_exports_and_loads_strict(tmp_path):
    from zerompi.data import default_corpus
    from zerompi.models.gpt import GPT, PRESETS

    corpus = default_corpus(tmp_path / "cache", max_bytes=100_000)
    run = tmp_path / "run"
    run_mpi(2, ["-m", "zerompi.train", "--model.preset", "tiny", "--data", str(corpus), "--run_dir", str(run),
                "--max_steps", "4", "--global_batch", "4", "--eval_interval", "0", "--checkpoint_interval", "2",
                "--progress", "none", "--threads", "1"], module=False, timeout=90)
    # The paths docs/checkpoints.md names: RUN_DIR/checkpoints/step_NNNNNNN and `latest`.
    ckpts = run / "checkpoints"
    assert (ckpts / "step_0000004" / "index.h5").exists()
    assert (ckpts / "latest").read_text().strip() == "step_0000004"
    out = _export(ckpts, tmp_path / "export")  # the default: both files
    assert "model.pt" in out and "model.safetensors" in out
    model = GPT(PRESETS["tiny"])
    sd = torch.load(tmp_path / "export" / "model.pt", weights_only=True)
    model.load_state_dict(sd, strict=True)
    assert model.lm_head.weight is model.wte.weight  # still tied after the load
    assert sd["lm_head.weight"].data_ptr() == sd["wte.weight"].data_ptr()
    safetensors = pytest.importorskip("safetensors.torch")
    model2 = GPT(PRESETS["tiny"])
    model2.load_state_dict(safetensors.load_file(tmp_path / "export" / "model.safetensors"), strict=True)
    for (n, a), (_, b) in zip(model.state_dict().items(), model2.state_dict().items()):
        assert torch.equal(a, b), n


def test_transformers_gpt2_round_trip_strict(tmp_path):
    tf = pytest.importorskip("transformers")
    res = run_worker(2, "hf_export", ["--dir", str(tmp_path / "ckpt")], tmp_path, timeout=180)
    _export(tmp_path / "ckpt", tmp_path / "export")
    full = torch.load(tmp_path / "ckpt" / "full.pt", weights_only=True)
    model = tf.GPT2LMHeadModel(tf.GPT2Config(**{k: v for k, v in res["config"].items()
                                                 if k not in ("transformers_version",)}))
    sd = torch.load(tmp_path / "export" / "model.pt", weights_only=True)
    model.load_state_dict(sd, strict=True)
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), full[name]), name  # what the engine trained
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()
    # transformers' own loader reads the same safetensors file from a folder with a config
    model.config.save_pretrained(tmp_path / "export")
    again = tf.GPT2LMHeadModel.from_pretrained(tmp_path / "export")
    for (n, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), n
