"""`python -m zerompi.train` end to end at N=2 (and N=1): the loss falls,
metrics are well formed, overrides and bad keys behave, a signal checkpoints and the
rerun finishes exactly like an uninterrupted run, the plot command draws a PNG, and a
tp = 2 run resumes at tp = 1 and exports weights the plain GPT loads strictly."""
import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from mpirun import launch, mpi_env, run_mpi, running_job, torch_unimportable

TRAIN = ["-m", "zerompi.train"]
# A few steps of the tiny model on a small private corpus (fast, no ~/.cache writes).
# lr_decay_steps is fixed so that a shorter run follows the same schedule (same losses).
FAST = ["--model.preset", "tiny", "--global_batch", "8", "--max_steps", "30", "--warmup_steps", "5",
        "--lr_decay_steps", "30", "--zero.optimizer.lr", "3e-3", "--min_lr", "3e-4",
        "--eval_interval", "10", "--eval_batches", "2",
        "--checkpoint_interval", "0", "--log_interval", "10", "--progress", "lines", "--zero.stage", "2"]


def train(n, run_dir, corpus, *extra, check=True, timeout=60, env=None):
    return run_mpi(n, TRAIN + FAST + ["--data", corpus, "--run_dir", str(run_dir)] + list(extra),
                   timeout=timeout, env=env, module=False, check=check)


def metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, corpus):
    run_dir = tmp_path_factory.mktemp("run") / "tiny"
    res = train(2, run_dir, corpus)
    return run_dir, res


def test_cli_trains_and_loss_falls(tiny_run):
    run_dir, res = tiny_run
    assert "done, 30 steps" in res.stdout
    losses = [m["loss"] for m in metrics(run_dir)]
    assert losses[0] > 5.0  # ~ln(256) at the start
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0, losses
    assert res.elapsed < 30, res.elapsed


def test_metrics_jsonl_is_well_formed(tiny_run):
    run_dir, _ = tiny_run
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 31))
    keys = {"step", "loss", "lr", "grad_norm", "loss_scale", "tokens_per_s", "step_time", "rss",
            "model_state_bytes", "mfu", "tokens"}
    for r in rows:
        assert keys <= r.keys(), keys - r.keys()
        assert r["loss"] > 0 and r["grad_norm"] > 0 and r["step_time"] > 0 and r["rss"] > 0
        assert r["tokens"] == r["step"] * 8 * 64
    assert [r["step"] for r in rows if "val_loss" in r] == [10, 20, 30]
    assert rows[0]["lr"] < rows[4]["lr"]            # warm-up
    assert 3e-4 <= rows[-1]["lr"] < 3.2e-4           # cosine decayed to ~min_lr
    cfg = json.loads((run_dir / "config.json").read_text())
    assert cfg["zero"]["stage"] == 2 and cfg["global_batch"] == 8


def test_rerun_repeats_the_loss_curve_exactly(tmp_path, corpus, tiny_run):
    train(2, tmp_path / "again", corpus, "--max_steps", "8")
    assert [r["loss"] for r in metrics(tmp_path / "again")] == [r["loss"] for r in metrics(tiny_run[0])[:8]]


def test_uneven_rows_give_the_single_rank_losses(tmp_path, corpus):
    """Exact loss weighting: B=3 rows in 2 micro-steps gives the 2 ranks 2 and 1 rows (rank
    1 none in micro-step 1), and still matches N=1 up to summation order, val loss included."""
    args = ["--global_batch", "3", "--zero.gradient_accumulation_steps", "2", "--max_steps", "6",
            "--eval_interval", "3"]
    train(1, tmp_path / "n1", corpus, *args)
    train(2, tmp_path / "n2", corpus, *args)
    a, b = metrics(tmp_path / "n1"), metrics(tmp_path / "n2")
    assert [r["loss"] for r in b] == pytest.approx([r["loss"] for r in a], rel=1e-5)
    assert [r["val_loss"] for r in b if "val_loss" in r] == \
        pytest.approx([r["val_loss"] for r in a if "val_loss" in r], rel=1e-5)


def test_overrides_reach_the_config(tmp_path, corpus):
    cfg_file = tmp_path / "c.toml"
    cfg_file.write_text('max_steps = 50\n[zero]\nstage = 2\n')
    train(2, tmp_path / "o", corpus, "--config", str(cfg_file), "max_steps=3", "--zero.stage", "1",
          "--zero.optimizer.betas", "0.8,0.9", "eval_interval=0")
    cfg = json.loads((tmp_path / "o" / "config.json").read_text())
    assert cfg["max_steps"] == 3 and cfg["zero"]["stage"] == 1
    assert cfg["zero"]["optimizer"]["betas"] == [0.8, 0.9]
    assert len(metrics(tmp_path / "o")) == 3


def test_bad_key_fails_fast_naming_it(tmp_path, corpus, without_torch):
    """Exit 2 and the message once (rank 0), not once per rank, before any rank imports
    torch; the messages of other bad keys, from the same parser: tests/unit/test_config.py."""
    res = train(2, tmp_path / "bad", corpus, "--zero.stag", "2", check=False, timeout=30, env=without_torch)
    needle = "config key 'zero.stag' = '2': unknown key"
    assert res.returncode == 2, res.stdout[-2000:]
    assert res.stdout.count(needle) == 1  # printed once (rank 0), not once per rank
    assert res.elapsed < 15


def train_cli(cmd, timeout=60, env=None):
    """`mpiexec ...CMD` with stdout and stderr apart: (rc, out, err)."""
    res = launch(["mpiexec"] + cmd, timeout, env=env, stderr_apart=True)
    return res.returncode, res.stdout, res.stderr


@pytest.fixture(scope="module")
def without_torch(tmp_path_factory):
    """The command checks and agrees its config before it imports torch (zerompi/train.py),
    so a bad one ends every rank within a second, whatever the job's size."""
    return torch_unimportable(tmp_path_factory.mktemp("no-torch"))


def assert_one_error_line(rc, out, err, needle):
    """Exit 2 and a single `zerompi.train: error...` line on stderr, from rank 0 only."""
    assert rc == 2, (out[-2000:], err[-2000:])
    assert "Traceback" not in out + err, err
    assert err.splitlines() == [err.strip()] and err.startswith("zerompi.train: error"), err
    assert needle in err, err


@pytest.mark.parametrize("args,needle", [
    (["zero.tensor_parallel_size=3"],
     "error: config key 'zero.tensor_parallel_size' = 3: must divide the number of ranks (2)"),
    (["zero.tensor_parallel_size=2", "model.dropout=0.1"],
     "error: config key 'zero.tensor_parallel_size' = 2: the model's dropout (0.1) must be 0"),
])
def test_config_error_is_one_line_on_stderr(tmp_path, corpus, args, needle, without_torch):
    """Errors that depend on the job (its number of ranks) or the model, found before
    torch is imported; values checked by the config alone (zero.optimizer.lr = -1, ...):
    tests/unit/test_config.py."""
    run_dir = tmp_path / "bad"
    rc, out, err = train_cli(["-n", "2", sys.executable] + TRAIN + FAST
                             + ["--data", corpus, "--run_dir", str(run_dir)] + args, env=without_torch)
    assert_one_error_line(rc, out, err, needle)
    assert not run_dir.exists()  # failed before anything was written


def test_rank_with_another_config_is_named(tmp_path, corpus, without_torch):
    """Ranks launched with different arguments (MPMD) agree to stop, and rank 1 is named."""
    argv = [sys.executable] + TRAIN + FAST + ["--data", corpus, "--run_dir", str(tmp_path / "r")]
    rc, out, err = train_cli(["-n", "1"] + argv + [":", "-n", "1"] + argv + ["--max_steps", "4"], env=without_torch)
    assert_one_error_line(rc, out, err, "error: rank 1 has a different config than rank 0: "
                                        "max_steps = 4 (rank 0: 30)")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_a_gpu_is_a_config_error(tmp_path, corpus):
    """One line, and like any config error it leaves nothing behind: the run directory is
    claimed only once the device is agreed (trainer/preflight.py)."""
    rc, out, err = train_cli(["-n", "2", sys.executable] + TRAIN + FAST
                             + ["--data", corpus, "--run_dir", str(tmp_path / "r"), "--device", "cuda"])
    assert_one_error_line(rc, out, err, "error: config key 'device' = 'cuda': no CUDA device visible")
    assert not (tmp_path / "r").exists()


def test_signal_checkpoints_exits_124_and_rerun_matches(tmp_path, corpus, tiny_run):
    args = ["--checkpoint_interval", "1000", "--keep_last", "2"]

    run_dir = tmp_path / "int"
    cmd = ["mpiexec", "-n", "2", sys.executable] + TRAIN + FAST + [
        "--data", corpus, "--run_dir", str(run_dir)] + args
    path = run_dir / "metrics.jsonl"
    with running_job(cmd, lambda: path.exists() and len(path.read_text().splitlines()) >= 5, 30) as p:
        os.killpg(p.pid, signal.SIGUSR1)  # as Slurm's --signal does; mpiexec forwards it
        out, _ = p.communicate(timeout=30)
    assert p.returncode == 124, out[-3000:]
    assert "SIGUSR1 received" in out
    stopped_at = len(metrics(run_dir))
    assert 5 <= stopped_at < 30
    assert (run_dir / "checkpoints" / f"step_{stopped_at:07d}").is_dir()
    # A kill between the checkpoint's publication and its step's line loses the line:
    # the checkpoint holds a copy, which the rerun writes back.
    lines = path.read_text().splitlines()
    lost = json.loads(lines[-1])
    path.write_text("".join(line + "\n" for line in lines[:-1]))

    res = train(2, run_dir, corpus, *args)
    assert f"resumed at step {stopped_at}" in res.stdout
    ref, got = metrics(tiny_run[0]), metrics(run_dir)  # the uninterrupted run
    assert [r["step"] for r in got] == list(range(1, 31))
    assert got[stopped_at - 1] == {k: v for k, v in lost.items() if k != "checkpoints"}, (got[stopped_at - 1], lost)
    assert got[-1]["loss"] == ref[-1]["loss"]
    assert [r["loss"] for r in got] == [r["loss"] for r in ref]


def test_restarting_a_finished_run_does_nothing(tiny_run, corpus):
    """A requeue after the last step: resume from the final checkpoint, exit 0 at once."""
    run_dir, _ = tiny_run
    before = (run_dir / "metrics.jsonl").read_text()
    res = train(2, run_dir, corpus)
    assert "resumed at step 30" in res.stdout and "done" in res.stdout
    assert (run_dir / "metrics.jsonl").read_text() == before


def test_plot_writes_png(tiny_run, tmp_path):
    run_dir, _ = tiny_run
    out = tmp_path / "curves.png"
    res = subprocess.run([sys.executable, "-m", "zerompi.plot", str(run_dir), "--out", str(out)],
                         capture_output=True, text=True, env=mpi_env(), timeout=60)
    assert res.returncode == 0, res.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_trainer_tp2_then_resume_at_tp1_and_export(corpus, tmp_path):
    """`zerompi.train --zero.tensor_parallel_size 2` on 4 ranks with Pa, then the same
    run_dir resumed on 2 ranks at tp 1; the exported weights load strictly into the plain
    GPT (full shapes, no vocabulary padding)."""
    import torch

    from zerompi.models.gpt import GPT, PRESETS

    run = tmp_path / "run"
    common = ["-m", "zerompi.train", "--model.preset", "tiny", "--data", str(corpus), "--run_dir", str(run),
              "--global_batch", "4", "--eval_interval", "0", "--progress", "none", "--threads", "1",
              "--zero.stage", "3"]
    r = run_mpi(4, common + ["--max_steps", "3", "--zero.tensor_parallel_size", "2",
                             "--zero.activation_checkpointing.enabled", "true",
                             "--zero.activation_checkpointing.partition", "true"], module=False, timeout=120)
    assert "4 ranks x 1 threads (dp 2 x tp 2)" in r.stdout, r.stdout[-2000:]
    r = run_mpi(2, common + ["--max_steps", "5"], module=False, timeout=120)
    assert "resumed at step 3" in r.stdout, r.stdout[-2000:]
    p = subprocess.run([sys.executable, "-m", "zerompi.export", str(run / "checkpoints"), str(tmp_path / "x"),
                        "--format", "torch"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    GPT(PRESETS["tiny"]).load_state_dict(torch.load(tmp_path / "x" / "model.pt", weights_only=True), strict=True)
