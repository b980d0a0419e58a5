"""Hugging Face weights in and out through the train command (issue 41; docs/models.md).

Llama: a tiny LlamaForCausalLM (GQA, untied, saved by transformers as shards with an
index) trains at stage 3 on 2 ranks via --init_from and tracks transformers +
torch.optim.AdamW in this process on the same batches (the parity measure of
support/parity_checks.py: losses within 1e-5, gradient norms within 1e-5 relative, final
weights within 16 x the rounding floor of two exact references); `export --hf` of the run
loads strictly with AutoModelForCausalLM, holds the weights the run trained, gives our
Llama's logits on them (1e-5 relative: tests/unit/test_llama.py says why), and carries the
run's tokenizer. GPT: a GPT2LMHeadModel (exact GELU) starts a stage-1 run (its first loss
is transformers' on the first batch: the Conv1D weights were transposed in), and the
export loads strictly as GPT2LMHeadModel with our GPT's logits; without a tokenizer the
export says so."""
import json
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mpirun import mpi_env, run_mpi
from parity_checks import ULP1

tf = pytest.importorskip("transformers")
LR, B, T, STEPS = 1e-2, 4, 16, 3


def _train(tmp_path, name, *args):
    from zerompi.data import default_corpus

    corpus = default_corpus(tmp_path / "cache", max_bytes=100_000)
    run = tmp_path / name
    run_mpi(2, ["-m", "zerompi.train", "--data", str(corpus), "--run_dir", str(run), "--block_size", str(T),
                "--global_batch", str(B), "--max_steps", str(STEPS), "--eval_interval", "0", "--warmup_steps", "0",
                "--zero.optimizer.lr", str(LR), "--min_lr", str(LR), "--zero.optimizer.weight_decay", "0",
                "--progress", "none", "--threads", "1", *args], module=False, timeout=150)
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return corpus, run, metrics


def _export(run, out, *extra):
    p = subprocess.run([sys.executable, "-m", "zerompi.export", str(run / "checkpoints"), "--hf", str(out), *extra],
                       capture_output=True, text=True, env=mpi_env(), timeout=120)
    assert p.returncode == 0, p.stderr
    model, info = tf.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert all(not v for v in info.values()), info  # strict: nothing missing, unexpected, mismatched
    return p.stdout, model.eval()


def _batches(corpus, seed=1337):
    from zerompi.data import TokenSampler, split_tokens
    from zerompi.data.tokens import open_tokens

    train, _ = split_tokens(open_tokens(str(corpus)), 0.05)
    s = TokenSampler(train, T, seed=seed)
    return [s.global_batch(step, B) for step in range(STEPS)]


def _reference(model, batches, halves=False):
    """transformers + AdamW in this process; halves: the batch as two averaged halves
    (2 ranks' worth), whose difference from the whole is the rounding floor."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, foreach=False)
    losses, norms = [], []
    for x, y in batches:
        opt.zero_grad()
        parts = ((x[:B // 2], y[:B // 2]), (x[B // 2:], y[B // 2:])) if halves else ((x, y),)
        tot = 0.0
        for xs, ys in parts:
            loss = F.cross_entropy(model(input_ids=xs).logits.reshape(-1, model.config.vocab_size), ys.reshape(-1))
            (loss / len(parts)).backward()
            tot += loss.item() / len(parts)
        losses.append(tot)
        norms.append(float(torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters()))))
        opt.step()
    return losses, norms


def _ours_logits(family, out, x):
    from zerompi.models.arch import build
    from zerompi.models.hf_names import config_from_hf
    from zerompi.models.hf_weights import HFCheckpoint

    _, shape = config_from_hf(json.loads((out / "config.json").read_text()))
    model = build(shape).eval()
    src = HFCheckpoint(str(out), family)
    model.load_state_dict({k: src[k] for k in src}, strict=False)
    named = {n for n, _ in model.named_parameters()}
    assert named <= set(src) | {"lm_head.weight"}, named - set(src)  # every parameter from the export
    with torch.no_grad():
        return model(x)


def test_llama_init_from_stage3_tracks_transformers_and_exports(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    hc = tf.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    tf.LlamaForCausalLM(hc).save_pretrained(tmp_path / "hf", max_shard_size="40KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()  # sharded
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))

    corpus, run, metrics = _train(tmp_path, "run", "--init_from", str(tmp_path / "hf"), "--zero.stage", "3",
                                  "--tokenizer", str(tmp_path / "tokenizer.json"))
    batches = _batches(corpus)
    ref = tf.LlamaForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager")
    losses, norms = _reference(ref, batches)
    # The rounding floor: two exact references that differ only in rounding (the batch as
    # two halves, as 2 ranks sum it; torch's fused attention, as our Llama computes it).
    # Adam turns an element's near-zero gradient of either sign into a full step, so a
    # handful of elements move by far more than rounding: the floor is measured, not guessed.
    floor = 0.0
    for impl, halves in (("eager", True), ("sdpa", False)):
        other = tf.LlamaForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation=impl)
        _reference(other, batches, halves=halves)
        floor = max(floor, max((a - b).abs().max().item() for a, b in zip(other.parameters(), ref.parameters())))
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for m, loss, norm in zip(metrics, losses, norms):
        assert abs(m["loss"] - loss) <= 1e-5, (m["loss"], loss)
        assert abs(m["grad_norm"] - norm) <= 1e-5 * norm, (m["grad_norm"], norm)
    assert losses[-1] < losses[0]  # it trained

    stdout, exported = _export(run, tmp_path / "export", "--max-shard-size", "40KB")
    assert (tmp_path / "export" / "model.safetensors.index.json").exists()
    refp = dict(ref.named_parameters())
    diffs = torch.cat([(p.detach() - refp[n].detach()).abs().view(-1) for n, p in exported.named_parameters()])
    assert diffs.max() <= 16 * max(floor, ULP1), (diffs.max(), floor)
    assert (diffs > 1e-5).sum() <= 1e-3 * diffs.numel(), int((diffs > 1e-5).sum())  # the bulk: rounding only
    x = batches[0][0]
    with torch.no_grad():
        want = exported(input_ids=x).logits
    got = _ours_logits("llama", tmp_path / "export", x)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    # the run's tokenizer travelled with it
    assert "tokenizer.json" in stdout and "no tokenizer" not in stdout
    again = tf.AutoTokenizer.from_pretrained(tmp_path / "export")
    assert again("hello world there")["input_ids"] == [1, 2, 0]


def test_gpt2_init_from_and_export_round_trip(tmp_path):
    hc = tf.GPT2Config(vocab_size=256, n_positions=32, n_embd=32, n_layer=2, n_head=2, activation_function="gelu",
                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(1)
    hf = tf.GPT2LMHeadModel(hc).eval()
    hf.save_pretrained(tmp_path / "hf")
    corpus, run, metrics = _train(tmp_path, "run", "--init_from", str(tmp_path / "hf"), "--zero.stage", "1")
    x, y = _batches(corpus)[0]
    with torch.no_grad():
        first = F.cross_entropy(hf(input_ids=x).logits.reshape(-1, 256), y.reshape(-1)).item()
    assert abs(metrics[0]["loss"] - first) <= 1e-5, (metrics[0]["loss"], first)  # the file's weights, transposed in

    stdout, exported = _export(run, tmp_path / "export")
    assert type(exported).__name__ == "GPT2LMHeadModel"
    assert "note: no tokenizer" in stdout
    assert not (tmp_path / "export" / "tokenizer.json").exists()
    assert exported.lm_head.weight.data_ptr() == exported.transformer.wte.weight.data_ptr()
    assert not torch.equal(exported.transformer.h[0].attn.c_attn.weight, hf.transformer.h[0].attn.c_attn.weight)
    with torch.no_grad():
        want = exported(input_ids=x).logits
    got = _ours_logits("gpt", tmp_path / "export", x)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    assert np.isfinite([m["loss"] for m in metrics]).all()


def test_llama_init_from_at_tp2(tmp_path):
    """--init_from under tensor parallelism: the reading rank cuts each tp rank's slices
    (zero/load_full.py); the first loss is transformers' on the first batch."""
    hc = tf.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5,
                        tie_word_embeddings=True)
    torch.manual_seed(2)
    hf = tf.LlamaForCausalLM(hc).eval()
    hf.save_pretrained(tmp_path / "hf")
    corpus, _, metrics = _train(tmp_path, "run", "--init_from", str(tmp_path / "hf"), "--zero.stage", "1",
                                "--zero.tensor_parallel_size", "2", "--checkpoint_interval", "0")
    x, y = _batches(corpus)[0]
    with torch.no_grad():
        first = F.cross_entropy(hf(input_ids=x).logits.reshape(-1, 256), y.reshape(-1)).item()
    assert abs(metrics[0]["loss"] - first) <= 1e-5, (metrics[0]["loss"], first)
