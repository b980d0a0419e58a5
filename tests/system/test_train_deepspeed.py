"""`zerompi.train --deepspeed_config FILE` (the mapping itself: tests/unit/test_ds_config.py)."""
import json

from ds_example import DS
from mpirun import run_mpi


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
