"""`python -m zerompi.train` with background saves (checkpoint.async_save true):
every way a run ends flushes the save in flight (a stop signal, the non-finite stop) or
never publishes it (an exception on one rank); metrics and progress show each save's
stall and background write time. The writes are slowed (workers/train_faults.py) so that
a save is in flight when the run ends."""
import json
import os
import shutil
import signal
import sys

from mpirun import WORKERS, launch, running_job

from zerompi.checkpoint import verify_checkpoint

FAST = ["--model.preset", "tiny", "--global_batch", "4", "--max_steps", "30", "--warmup_steps", "1",
        "--lr_decay_steps", "20", "--eval_interval", "0", "--keep_last", "0", "--log_interval", "1",
        "--progress", "lines", "--zero.stage", "2", "--threads", "1", "--checkpoint.async_save", "true"]


def cmd(run_dir, corpus, *extra):
    return ["mpiexec", "-n", "2", sys.executable, str(WORKERS / "train_faults.py")] + FAST + [
        "--data", corpus, "--run_dir", str(run_dir)] + list(extra)


def visible(ck):
    """The checkpoints load and resume could pick, each verified."""
    out = sorted(e for e in os.listdir(ck) if e.startswith("step_"))
    for e in out:
        verify_checkpoint(ck / e)
    return out


def test_every_way_a_run_ends_flushes_or_never_publishes(tmp_path, corpus):
    run = tmp_path / "run"
    ck, metrics = run / "checkpoints", run / "metrics.jsonl"
    # 1. SIGUSR1 while a save (every 2 steps, each write 1.5 s late) is in flight: it is
    #    published, then the stop checkpoint is written at once; exit 124 for a requeue.
    env = {"ZEROMPI_TEST_SLOW_WRITE": "1.5"}
    with running_job(cmd(run, corpus, "--checkpoint_interval", "2"),
                     lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 5, 60, env=env) as p:
        os.killpg(p.pid, signal.SIGUSR1)
        out, _ = p.communicate(timeout=60)
    assert p.returncode == 124, out[-3000:]
    rows = [json.loads(ln) for ln in metrics.read_text().splitlines()]
    k = rows[-1]["step"]
    saved = [c for r in rows for c in r.get("checkpoints", [])]
    assert saved[0]["tag"] == "step_0000002" and saved[-1]["tag"] == f"step_{k:07d}", saved
    for c in saved:
        assert c.keys() == {"tag", "stall_s", "write_s", "waited_s"} and c["write_s"] >= 0 and c["stall_s"] >= 0, c
    assert saved[0]["write_s"] >= 1.5 > saved[0]["stall_s"], saved[0]   # written in the background
    assert "checkpoint step_0000002 saved (stall " in out and ", background write " in out, out[-3000:]
    assert visible(ck) == [c["tag"] for c in saved] and (ck / "latest").read_text().strip() == f"step_{k:07d}"

    # 2. The non-finite stop (lr 1e30 from the resume on) while the save of step k+1 is in
    #    flight: it is finished and published before the job ends (exit 4).
    div = tmp_path / "div"
    shutil.copytree(run, div)
    res = launch(cmd(div, corpus, "--checkpoint_interval", "1", "--zero.optimizer.lr", "1e30", "--min_lr", "0"),
                 90, env={"ZEROMPI_TEST_SLOW_WRITE": "3"}, stderr_apart=True)
    assert res.returncode == 4 and "3 steps in a row with a non-finite" in res.stderr, res.stderr[-3000:]
    assert f"step {k + 2} was not finite: no checkpoint" in res.stderr, res.stderr[-3000:]
    assert visible(div / "checkpoints")[-1] == f"step_{k + 1:07d}"
    assert (div / "checkpoints" / "latest").read_text().strip() == f"step_{k + 1:07d}"

    # 3. An exception on rank 1 while the save of step k+1 is in flight: never published.
    exc = tmp_path / "exc"
    shutil.copytree(run, exc)
    res = launch(cmd(exc, corpus, "--checkpoint_interval", "1"), 90, stderr_apart=True,
                 env={"ZEROMPI_TEST_SLOW_WRITE": "3", "ZEROMPI_TEST_RAISE_AT": f"1:{k + 1}"})
    assert res.returncode != 0 and f"test fault on rank 1 after step {k + 1}" in res.stderr, res.stderr[-3000:]
    assert visible(exc / "checkpoints") == visible(ck)
    assert (exc / "checkpoints" / "latest").read_text().strip() == f"step_{k:07d}"
    assert [e for e in os.listdir(exc / "checkpoints") if e.startswith(f".tmp-step_{k + 1:07d}-")]
