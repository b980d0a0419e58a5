"""`python -m zerompi.train` with the offloaded optimizer's staged pipeline and its delayed
update, at N = 2 on the CPU: the loss falls, every step's metrics carry the phases
(docs/offload.md), and the checkpoint the run ends with loads and resumes."""
import json

from mpirun import run_mpi

RUN = ["-m", "zerompi.train", "--model.preset", "tiny", "--global_batch", "8", "--warmup_steps", "2",
       "--lr_decay_steps", "20", "--zero.optimizer.lr", "3e-3", "--eval_interval", "0", "--log_interval", "10",
       "--progress", "lines", "--zero.stage", "2", "--zero.precision", "bf16",
       "--zero.offload_optimizer", "cpu", "--zero.offload.delayed_update", "true"]


def metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_delayed_offload_trains_reports_phases_and_resumes(tmp_path, corpus):
    run_dir = tmp_path / "run"
    args = ["--data", corpus, "--run_dir", str(run_dir), "--checkpoint_interval", "10"]
    run_mpi(2, RUN + args + ["--max_steps", "20"], timeout=120, module=False)
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 21))
    assert sum(r["loss"] for r in rows[-3:]) / 3 < rows[0]["loss"] - 0.3, [r["loss"] for r in rows]
    for r in rows:
        assert r["offload_delayed"] is True and r["offload_threads"] >= 1 and r["offload_host_bytes"] > 0
    assert all(r["offload_host_pass"] > 0 for r in rows[1:])  # the first step has no pass to wait for
    run_mpi(2, RUN + args + ["--max_steps", "24"], timeout=120, module=False)  # resumes from step 20
    again = metrics(run_dir)
    assert [r["step"] for r in again] == list(range(1, 25)) and again[:20] == rows
