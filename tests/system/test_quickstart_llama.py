"""docs/quickstart.md, "From your documents to a fine-tuned Llama", as a user runs it: a
folder of JSONL documents and a local HF Llama (tiny, made here; its tokenizer trained
here) -> `zerompi.prepare` with the model's tokenizer -> `zerompi.train --init_from` at
stage 3 on 2 ranks -> `zerompi.export --hf` -> transformers loads model and tokenizer
strictly, and the exported weights are the trained ones (they moved from the start)."""
import subprocess
import sys

import torch
from mpirun import ROOT, mpi_env, run_mpi
from tiny_corpus import documents, train_tokenizer, write_jsonl

# The quickstart's three commands, with this test's paths in place of its names.
PREPARE = "python -m zerompi.prepare docs/ --field text --tokenizer llama/tokenizer.json --val_fraction 0.01 --out data/docs"
TRAIN = ("mpiexec -n 2 python -m zerompi.train --init_from llama --tokenizer llama/tokenizer.json --data data/docs "
         "--zero.stage 3 --max_steps 100 --run_dir runs/llama")
EXPORT = "python -m zerompi.export runs/llama/checkpoints --hf exports/llama"


def test_documents_to_llama_fine_tune_to_hf_export(tmp_path):
    import transformers as tf

    (tmp_path / "docs").mkdir()
    docs = documents(120, seed=3)
    write_jsonl(tmp_path / "docs" / "a.jsonl", docs[:60])
    write_jsonl(tmp_path / "docs" / "b.jsonl", docs[60:])
    (tmp_path / "llama").mkdir()
    tok = train_tokenizer(tmp_path / "llama" / "tokenizer.json", vocab_size=300)
    hc = tf.LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    start = tf.LlamaForCausalLM(hc)
    start.save_pretrained(tmp_path / "llama")

    def cmd(line, *extra):  # the doc's command with its relative paths under tmp_path
        words = line.split()
        rel = ("llama", "data", "runs", "docs", "exports")
        return [str(tmp_path / w) if w.split("/")[0] in rel else w for w in words[words.index("python") + 1:]] + \
            list(extra)

    p = subprocess.run([sys.executable, *cmd(PREPARE), "--progress", "none"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    # a short run of the doc's command (100 steps -> 4); small batches for the tiny corpus
    res = run_mpi(2, cmd(TRAIN, "--max_steps", "4", "--block_size", "32", "--global_batch", "4",
                         "--warmup_steps", "0", "--eval_interval", "0", "--progress", "none", "--threads", "1"),
                  module=False, timeout=180)
    assert "Llama" in res.stdout and "weights from " in res.stdout, res.stdout
    p = subprocess.run([sys.executable, *cmd(EXPORT)], cwd=ROOT, capture_output=True, text=True,
                       env=mpi_env(), timeout=120)
    assert p.returncode == 0, p.stderr
    model, info = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "exports/llama", output_loading_info=True)
    assert all(not v for v in info.values()), info  # strict
    again = tf.AutoTokenizer.from_pretrained(tmp_path / "exports/llama")
    from tokenizers import Tokenizer

    text = docs[0]
    assert again(text)["input_ids"] == Tokenizer.from_file(str(tok)).encode(text).ids
    moved = max((a - b).abs().max().item() for a, b in zip(model.parameters(), start.parameters()))
    assert 0 < moved < 0.1, moved  # trained from the checkpoint's weights, not from scratch
