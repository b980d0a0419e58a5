"""JSONL and Parquet -> `python -m zerompi.prepare` (a tokenizer trained in the test) ->
`zerompi.train` on 2 ranks in epoch order with the document mask; a run stopped mid-epoch
and resumed gives the same losses, gradient norms, validation losses and final weights as
the uninterrupted run, across the epoch boundary. prepare itself on 2 MPI ranks, and its
peak memory against the input size."""
import json
import os
import subprocess
import sys

from mpirun import ROOT, run_mpi, torch_unimportable
from tiny_corpus import documents, train_tokenizer, write_jsonl, write_parquet

T, B = 64, 8
TRAIN = ["-m", "zerompi.train", "--model.preset", "tiny", "--model.vocab_size", "300", "--block_size", str(T),
         "--global_batch", str(B), "--warmup_steps", "3", "--lr_decay_steps", "14", "--zero.optimizer.lr", "3e-3",
         "--min_lr", "3e-4", "--eval_interval", "2", "--eval_batches", "1", "--checkpoint_interval", "0",
         "--progress", "lines", "--threads", "1", "--zero.stage", "2", "--data_order", "epoch", "--doc_mask", "true"]


def _metrics(run):
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def test_prepare_then_train_and_resume_mid_epoch_bitwise(tmp_path):
    docs = documents(90, seed=5)
    write_jsonl(tmp_path / "a.jsonl", docs[:45])
    write_parquet(tmp_path / "b.parquet", docs[45:], row_group_size=15)
    tok = train_tokenizer(tmp_path / "tokenizer.json")
    out = tmp_path / "data"
    p = subprocess.run([sys.executable, "-m", "zerompi.prepare", str(tmp_path / "a.jsonl"), str(tmp_path / "b.parquet"),
                        "--tokenizer", str(tok), "--out", str(out), "--val_fraction", "0.1", "--workers", "2",
                        "--unit_mb", "0.004", "--progress", "none"], capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    windows = (json.loads((out / "prepare.json").read_text())["tokens"]["train"] - 1) // T
    assert 6 * B < windows < 13 * B, windows  # the stop at step 6 is mid-epoch; step 14 is in epoch 2

    def train(run, steps):
        return run_mpi(2, TRAIN + ["--data", str(out), "--run_dir", str(run), "--max_steps", str(steps)],
                       module=False, timeout=120)

    res = train(tmp_path / "whole", 14)
    assert "zerompi shard" in res.stdout and "validation:" in res.stdout, res.stdout
    train(tmp_path / "parts", 6)
    res = train(tmp_path / "parts", 14)
    assert "resumed at step 6" in res.stdout, res.stdout
    whole, parts = _metrics(tmp_path / "whole"), _metrics(tmp_path / "parts")
    keys = ("step", "loss", "grad_norm", "val_loss")
    assert [[r.get(k) for k in keys] for r in parts] == [[r.get(k) for k in keys] for r in whole]
    assert len(whole) == 14 and whole[-1]["loss"] < whole[0]["loss"]

    from zerompi.export import export

    for name in ("whole", "parts"):
        export(str(tmp_path / name / "checkpoints"), str(tmp_path / f"x_{name}"), fmt_="safetensors")
    from safetensors.torch import load_file

    a, b = (load_file(tmp_path / f"x_{n}" / "model.safetensors") for n in ("whole", "parts"))
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)


def test_headerless_uint32_file_is_refused_in_one_line(tmp_path):
    """A uint32 token file with ids < 65,536 and no sidecar: refused, naming data_dtype; exit
    2, one line, no traceback, nothing started (data_dtype = uint16 on it: the uint32
    pattern's refusal, tests/unit/test_data_check.py, the same path out)."""
    import numpy as np

    (tmp_path / "t.bin").write_bytes((np.arange(40_000) % 250 + 1).astype(np.uint32).tobytes())
    res = run_mpi(2, ["-m", "zerompi.train", "--model.preset", "tiny", "--global_batch", "4", "--max_steps", "2",
                      "--eval_interval", "0", "--threads", "1", "--data", str(tmp_path / "t.bin"),
                      "--run_dir", str(tmp_path / "run")], module=False, check=False, timeout=60,
                  env=torch_unimportable(tmp_path / "no-torch"))  # refused before any rank imports torch
    assert res.returncode == 2 and res.stdout.count("a headerless token file") == 1, res.stdout
    assert "Traceback" not in res.stdout and "data_dtype = uint8 | uint16 | uint32" in res.stdout, res.stdout
    assert not (tmp_path / "run").exists()


def test_prepare_on_two_mpi_ranks_writes_the_same_bytes(tmp_path):
    """mpiexec -n 2 python -m zerompi.prepare: the ranks share the units (2 workers each);
    the output equals a 1-process run's, byte for byte; a bad field is one line, exit 2."""
    from zerompi.data.prepare import prepare

    write_jsonl(tmp_path / "a.jsonl", documents(120, seed=3))
    args = ["--val_fraction", "0.1", "--unit_mb", "0.002", "--progress", "none"]
    prepare([str(tmp_path / "a.jsonl")], str(tmp_path / "one"), val_fraction=0.1, unit_mb=0.002, progress=False)
    res = run_mpi(2, ["-m", "zerompi.prepare", str(tmp_path / "a.jsonl"), "--out", str(tmp_path / "two"),
                      "--workers", "2"] + args, module=False, timeout=120)
    assert "by 2 ranks x 2 workers" in res.stdout, res.stdout
    files = sorted(p.relative_to(tmp_path / "one") for p in (tmp_path / "one").rglob("*") if p.is_file())
    assert len(files) > 6 and files == sorted(p.relative_to(tmp_path / "two") for p in (tmp_path / "two").rglob("*")
                                              if p.is_file())
    assert all((tmp_path / "one" / f).read_bytes() == (tmp_path / "two" / f).read_bytes() for f in files)
    res = run_mpi(2, ["-m", "zerompi.prepare", str(tmp_path / "a.jsonl"), "--out", str(tmp_path / "bad"),
                      "--field", "body"] + args, module=False, check=False, timeout=120)
    assert res.returncode == 2 and res.stdout.count("has no 'body' field") == 1, res.stdout
    assert "Traceback" not in res.stdout


def test_memory_does_not_grow_with_the_input(tmp_path):
    """Peak RSS of a 1-worker prepare (unit_mb 1) with a 2 MB and a 24 MB JSONL: the growth
    is a small part of the 22 MB more input (loading it whole would add > 22 MB)."""
    line = b'{"text": "' + b"abcdefghij" * 99 + b'"}\n'

    def peak(mb):
        p = tmp_path / f"in{mb}.jsonl"
        with open(p, "wb") as f:
            for _ in range(mb):
                f.write(line * (2**20 // len(line)))
        # VmHWM: this process's peak (ru_maxrss would include the forking parent's)
        code = ("import sys; from zerompi.prepare import main; rc = main(sys.argv[1:]); "
                "print([ln.split()[1] for ln in open('/proc/self/status') if ln.startswith('VmHWM')][0]); sys.exit(rc)")
        out = subprocess.run([sys.executable, "-c", code, str(p), "--out", str(tmp_path / f"o{mb}"), "--workers", "1",
                              "--unit_mb", "1", "--progress", "none"], capture_output=True, text=True, check=True,
                             cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
        return int(out.stdout.split()[-1]) * 1024

    small, big = peak(2), peak(24)
    assert big - small < 6 * 2**20, (small, big)
