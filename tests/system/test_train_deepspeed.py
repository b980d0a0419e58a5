"""`python -m zerompi.train --deepspeed_config FILE` on 2 ranks: the file runs as DeepSpeed
would run it (the merge with --config, in one process: tests/unit/test_ds_train.py; the
mapping itself: tests/unit/test_ds_config.py)."""
import json
import math

from ds_schedulers import DeepSpeedScheduler
from mpirun import run_mpi, torch_unimportable

DS_RUN = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "steps_per_print": 1,
          "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
          "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 5, "warmup_num_steps": 2,
                                                             "warmup_min_ratio": 0.1, "cos_min_ratio": 0.05,
                                                             "warmup_type": "linear"}},
          "zero_optimization": {"stage": 2, "reduce_bucket_size": 2e5}}


def test_train_cli_runs_a_deepspeed_file_as_deepspeed_would(tmp_path):
    from zerompi.data import default_corpus

    corpus = default_corpus(tmp_path / "cache", max_bytes=100_000)
    (tmp_path / "ds.json").write_text(json.dumps(DS_RUN))
    run = tmp_path / "run"
    res = run_mpi(2, ["-m", "zerompi.train", "--deepspeed_config", str(tmp_path / "ds.json"), "--data", str(corpus),
                      "--model.preset", "tiny", "--max_steps", "4", "--eval_interval", "0", "--threads", "1",
                      "--progress", "lines", "--run_dir", str(run)], module=False, timeout=120)
    assert res.stdout.count("zerompi.train: warning: DeepSpeed config") == 1, res.stdout
    for once in ("which side wins: ", ", in effect: optimizer AdamW lr 0.003", "batch 8 = micro 2 x accumulation "
                 "2 x 2 data-parallel ranks", "zero_optimization.reduce_bucket_size 200,000 -> zero.bucket_size"):
        assert res.stdout.count(once) == 1, (once, res.stdout)
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["global_batch"] == 8 and cfg["zero"]["stage"] == 2 and cfg["zero"]["gradient_accumulation_steps"] == 2
    assert cfg["lr_schedule"] == "deepspeed_warmup_cosine" and cfg["zero"]["gradient_clipping"] == 1.0
    ref = DeepSpeedScheduler("WarmupCosineLR", 3e-3, **DS_RUN["scheduler"]["params"])
    for row in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()):  # fp32: every update applies
        assert math.isclose(row["lr"], ref.lr, rel_tol=1e-12, abs_tol=1e-18), (row, ref.lr)
        ref.step()
    (tmp_path / "sched.json").write_text(json.dumps({"scheduler": {"type": "OneCycle", "params": {
        "cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3}}}))  # zerompi.initialize runs it; the trainer refuses it
    bad = run_mpi(2, ["-m", "zerompi.train", "--deepspeed_config", str(tmp_path / "sched.json"), "--data",
                      str(corpus), "--run_dir", str(tmp_path / "bad")], module=False, timeout=60, check=False,
                  env=torch_unimportable(tmp_path / "no-torch"))  # refused before any rank imports torch
    assert bad.returncode == 2 and bad.stdout.count("deepspeed_config.scheduler.type") == 1, bad.stdout
