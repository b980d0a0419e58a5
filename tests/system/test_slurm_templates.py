"""The templates in slurm/ (see slurm/README.md), submitted unchanged with the real trainer
to the private Slurm of conftest's `slurm_cluster`:
  * cpu.sbatch runs a 2-rank zerompi.train to completion (test_train_cpu_sbatch);
  * cpu.sbatch near its time limit: signal, checkpoint, requeue, resume, completion
    (test_train_signal_checkpoint_requeue_resume);
  * sweep.sbatch as a 2-task array, one (stage, bucket_size) and run dir per task;
  * every template passes `bash -n` and `sbatch --test-only` (test_templates_parse).
`submit_mpi_job` / `submit_script` submit any batch script and wait for its final state.
"""
from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import time
from pathlib import Path

import pytest

from slurm_cluster import TERMINAL_STATES, parse_kv

from slurm_jobs import REPO, PY, REQUEUE_EXIT, _INIT_FLAKE, _write, _read, _diag, submit_script, wait_requeued

# ------------------------------------------------------------- the templates in slurm/

SLURM_DIR = REPO / "slurm"
TEMPLATES = sorted(SLURM_DIR.glob("*.sbatch"))
needs_train = pytest.mark.skipif(importlib.util.find_spec("zerompi.train") is None,
                                 reason="zerompi.train not available")

# A fast tiny run for the template tests: the tiny model on short sequences and small
# batches, no evaluation, checkpoints only at the end and on a stop signal.
FAST_CONFIG = """\
data = "default"
block_size = 32
global_batch = 8
max_steps = {max_steps}
warmup_steps = 5
lr_decay_steps = 1000      # fixed, so the LR schedule does not depend on max_steps
min_lr = 3e-4
eval_interval = 0
log_interval = 5
checkpoint_interval = 0
keep_last = 2
progress = "lines"

[model]
preset = "tiny"

[zero]
stage = 2

[zero.optimizer]
lr = 3e-3
"""


def _job_env(**extra) -> dict:
    # The batch shell runs `$PYTHON -m zerompi.train`: this interpreter, whatever PATH says.
    return {"PYTHON": PY, **{k: str(v) for k, v in extra.items()}}


def _metric_steps(run_dir: Path) -> list[int]:
    return [json.loads(ln)["step"] for ln in _read(run_dir / "metrics.jsonl").splitlines() if ln.strip()]


def _checkpoints(run_dir: Path) -> list[int]:
    return sorted(int(p.name.split("_")[1]) for p in (run_dir / "checkpoints").glob("step_*"))


def _in_order(text: str, patterns: list[str], why: str) -> None:
    """Each pattern matches a line of `text`, each after the previous one's first match."""
    lines = text.splitlines()
    prev = -1
    for pat in patterns:
        hits = [i for i, ln in enumerate(lines) if i > prev and re.search(pat, ln)]
        assert hits, f"no line matching {pat!r} after line {prev}" + why
        prev = hits[0]


def test_templates_parse(slurm_cluster):
    """(d) Every template is valid bash and valid sbatch input; the GPU ones are refused
    by this GPU-less test node for their resources only, and accepted once those fit."""
    names = {t.name for t in TEMPLATES}
    assert {"cpu.sbatch", "gpu.sbatch", "multinode-ib.sbatch", "sweep.sbatch"} <= names, names
    for f in [*TEMPLATES, SLURM_DIR / "_requeue.sh"]:
        r = subprocess.run(["bash", "-n", str(f)], capture_output=True, text=True)
        assert r.returncode == 0, f"bash -n {f.name}: {r.stderr}"
    fits_here = ["--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1", "--gpus-per-node=0"]
    for t in TEMPLATES:
        r = slurm_cluster.run(["sbatch", "--test-only", str(t)], cwd=REPO, check=False)
        out = r.stdout + r.stderr
        # A bad #SBATCH line makes sbatch exit 255 ("unrecognized option", "invalid ...").
        assert "unrecognized" not in out and r.returncode != 255, f"{t.name}: {out}"
        if t.name in ("gpu.sbatch", "multinode-ib.sbatch"):
            assert r.returncode != 0 and re.search(
                r"Invalid generic resource|Requested node configuration is not available", out), \
                f"{t.name}: expected a refusal for GPUs/nodes this node lacks, got rc={r.returncode}: {out}"
            r = slurm_cluster.run(["sbatch", "--test-only", *fits_here, str(t)], cwd=REPO, check=False)
            out = r.stdout + r.stderr
        assert r.returncode == 0 and "to start at" in out, f"{t.name}: rc={r.returncode}: {out}"


@needs_train
def test_train_cpu_sbatch(slurm_cluster, tmp_path):
    """(a) slurm/cpu.sbatch: `srun --mpi=pmi2` runs a 2-rank zerompi.train to completion."""
    run_dir = tmp_path / "run"
    job_id, state, log, elapsed = submit_script(
        slurm_cluster, SLURM_DIR / "cpu.sbatch", "train", tmp_path, cwd=REPO,
        args=["--max_steps", "10", "--eval_batches", "2"], options=["--time=5"],
        env=_job_env(CONFIG="configs/tiny.toml", RUN_DIR=run_dir), timeout=240)
    text, why = _read(log), _diag(slurm_cluster, job_id, log)
    print(f"train job {state} in {elapsed:.1f}s")
    assert state == "COMPLETED", why
    _in_order(text, [
        r"restart 0: 2 ranks x 1 threads",
        r"restart 0: running: srun --mpi=pmi2 --kill-on-bad-exit=1 \S+ -m zerompi\.train "
        r"--config configs/tiny\.toml --run_dir ",
        r"^zerompi\.train: .* 2 ranks x 1 threads",
        r"^zerompi\.train: done, 10 steps",
        r"srun exited with 0 \(USR1 received: 0\)",
    ], why)
    assert _metric_steps(run_dir) == list(range(1, 11)), why
    assert _checkpoints(run_dir) == [10], why



@needs_train
def test_train_signal_checkpoint_requeue_resume(slurm_cluster, tmp_path):
    """(b) cpu.sbatch near its time limit: USR1 -> checkpoint -> exit 124 -> requeue ->
    the SLURM_RESTART_COUNT=1 run resumes from that checkpoint and completes."""
    # slurmctld sends the --signal at its periodic check (every 30 s) once the job is
    # within lead + 30 s of its limit (measured: never later than due, up to 30 s early),
    # so @20 of 1 min lands 10-40 s into the run, after the trainer's start-up. Run 0
    # therefore starts with an unreachable max_steps and must be stopped by the signal.
    # While the job waits to run again (~11 s, see SlurmCluster's cred_expire), the test
    # sets max_steps to "checkpoint step + 10" in the config, which the trainer reads at
    # each start, and lengthens the time limit: Slurm re-arms --signal for the requeued
    # run, which should finish rather than stop again.
    cfg = _write(tmp_path / "fast.toml", FAST_CONFIG.format(max_steps=1_000_000))
    run_dir = tmp_path / "run"
    for attempt in (1, 2):
        t0 = time.monotonic()
        job_id = slurm_cluster.sbatch(
            SLURM_DIR / "cpu.sbatch", cwd=REPO, env=_job_env(CONFIG=cfg, RUN_DIR=run_dir),
            options=[f"--output={tmp_path}/requeue-%j.log", "--job-name=requeue",
                     "--time=1", "--signal=B:USR1@20"])
        log = tmp_path / f"requeue-{job_id}.log"
        info = wait_requeued(slurm_cluster, job_id, timeout=120)
        if attempt == 1 and info.get("JobState") != "PENDING" and _INIT_FLAKE.search(_read(log)):
            print(f"requeue: job {job_id} died in MPI_Init; resubmitting")
            continue
        break
    why = _diag(slurm_cluster, job_id, log)
    assert info.get("JobState") == "PENDING" and info.get("Restarts") == "1", why
    m = re.search(r"^zerompi\.train: SIGUSR1 received: checkpoint of step (\d+) saved", _read(log), re.M)
    assert m, "run 0 did not checkpoint on the signal" + why
    k = int(m.group(1))
    assert k > 0, why
    _write(cfg, FAST_CONFIG.format(max_steps=k + 10))
    slurm_cluster.scontrol("update", f"JobId={job_id}", "TimeLimit=5")
    # Both edits must land before the second run starts.
    assert slurm_cluster.state(job_id) == "PENDING", why

    state = slurm_cluster.wait(job_id, timeout=150)
    elapsed = time.monotonic() - t0
    text, why = _read(log), _diag(slurm_cluster, job_id, log)
    print(f"signal+requeue train job: checkpoint at step {k}, {state} in {elapsed:.1f}s")
    assert state == "COMPLETED", why
    assert slurm_cluster.job_info(job_id).get("Restarts") == "1", why
    # One append-mode log holds both runs, in this order.
    _in_order(text, [
        r"restart 0: 2 ranks",
        r"restart 0: USR1 \(time limit near\): relaying to the ranks",
        rf"^zerompi\.train: SIGUSR1 received: checkpoint of step {k} saved",
        rf"restart 0: srun exited with {REQUEUE_EXIT} \(USR1 received: 1\)",
        r"restart 0: checkpointed; requeueing",
        r"restart 1: 2 ranks",
        rf"^zerompi\.train: run_dir \S+; resumed at step {k}\b",
        rf"^zerompi\.train: done, {k + 10} steps",
        r"restart 1: srun exited with 0 \(USR1 received: 0\)",
    ], why)
    assert "starting at step 0" in text and text.count("starting at step 0") == 1, why
    # The signal's checkpoint and the final one; metrics go on from k+1, every step once.
    assert _checkpoints(run_dir) == [k, k + 10], why
    assert _metric_steps(run_dir) == list(range(1, k + 11)), why
    recs = [json.loads(ln) for ln in _read(run_dir / "metrics.jsonl").splitlines()]
    # `time` counts from each process's start: it falls back where run 1 took over.
    assert recs[k]["time"] < recs[k - 1]["time"], (recs[k - 1], recs[k])


def _array_tasks(cluster, array_id: int) -> dict[int, dict]:
    """{task index: record} for a job array (a pending range shows as one record)."""
    r = cluster.scontrol("-o", "show", "job", str(array_id), check=False, timeout=15)
    out = {}
    for line in r.stdout.splitlines():
        info = parse_kv(line)
        if info.get("ArrayTaskId", "").isdigit():
            out[int(info["ArrayTaskId"])] = info
    return out


@needs_train
def test_sweep_array(slurm_cluster, tmp_path):
    """(c) slurm/sweep.sbatch as a 2-task array: each task trains its own (stage, bucket)
    into its own run dir."""
    cfg = _write(tmp_path / "fast.toml", FAST_CONFIG.format(max_steps=5))
    sweep = tmp_path / "sweep"
    # 2 stages x 2 buckets; tasks 1 and 2 exercise both halves of the index mapping.
    expected = {1: (1, 300000), 2: (3, 100000)}
    t0 = time.monotonic()
    array_id = slurm_cluster.sbatch(
        SLURM_DIR / "sweep.sbatch", cwd=REPO,
        env=_job_env(CONFIG=cfg, SWEEP_DIR=sweep, STAGES="1 3", BUCKETS="100000 300000"),
        options=[f"--output={tmp_path}/sweep-%A_%a.log", "--array=1-2"])
    deadline = time.monotonic() + 180
    tasks: dict = {}
    while time.monotonic() < deadline:
        tasks = _array_tasks(slurm_cluster, array_id)
        if set(tasks) == set(expected) and all(t.get("JobState") in TERMINAL_STATES for t in tasks.values()):
            break
        time.sleep(0.5)
    logs = {i: tmp_path / f"sweep-{array_id}_{i}.log" for i in expected}
    why = (f"\n--- tasks: {tasks}\n" + "".join(f"--- {p.name}:\n{_read(p)}\n" for p in logs.values())
           + f"--- daemon logs:\n{slurm_cluster.log_tail(15)}")
    print(f"sweep array done in {time.monotonic() - t0:.1f}s")
    assert {i: t.get("JobState") for i, t in tasks.items()} == {i: "COMPLETED" for i in expected}, why
    run_dirs = set()
    for i, (stage, bucket) in expected.items():
        run_dir = sweep / f"stage{stage}-bucket{bucket}"
        run_dirs.add(run_dir)
        assert re.search(rf"array task {i} of {array_id}: stage {stage}, bucket_size {bucket},"
                         rf" 2 ranks, config \S+, run dir {re.escape(str(run_dir))}$",
                         _read(logs[i]), re.M), why
        used = json.loads(_read(run_dir / "config.json") or "{}")
        assert used.get("zero", {}).get("stage") == stage, (run_dir, used.get("zero"), why)
        assert used["zero"]["bucket_size"] == bucket, (run_dir, used["zero"], why)
        assert _metric_steps(run_dir) == [1, 2, 3, 4, 5], why
    assert len(run_dirs) == 2 and {p.name for p in sweep.iterdir()} == {p.name for p in run_dirs}, why
