"""MPI jobs under a real Slurm: a private one-node cluster on 127.0.0.1 (conftest's
`slurm_cluster`, built by tests/slurm_cluster.py). Needs root and .ci/install_slurm.sh;
skipped otherwise. About a minute, most of it waiting for slurmctld's 30 s time-limit
tick to deliver the --signal in the requeue test.

Launch rules these tests pin down (pip MPICH + Slurm 22.05):
  * `srun --mpi=pmi2 --kill-on-bad-exit=1` (pmi2 is the only plugin pip MPICH works with;
    without kill-on-bad-exit a rank that dies can leave the others waiting forever).
  * `--signal=B:USR1@N` signals only the batch shell (measured: srun and the ranks do not
    see it), so the batch script traps it and forwards it to srun, which relays it to
    every rank. Without `B:`, the ranks get it but the batch shell does not.
  * The ranks exit REQUEUE_EXIT after the stop; the batch script then runs
    `scontrol requeue`, and the next run sees SLURM_RESTART_COUNT=1.

Hook for zerompi.train tests: `submit_mpi_job(cluster, tmp_path, name, batch_text, ...)`
submits any batch script; test_train_cpu_sbatch (opt-in, ZEROMPI_SLURM_TRAIN=1) drives
slurm/cpu.sbatch with the real trainer.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
# zerompi.train's "stopped by a signal after checkpointing: requeue me" exit code.
REQUEUE_EXIT = 124

# MPICH names its /dev/shm segment after the PMI job id (Slurm job.step) and unlinks it
# once MPI_Init is done; a rank killed before that leaks it, and a later job with the same
# id then dies in MPI_Init ("UCX ERROR failed to unpack address", "Message truncated").
# SlurmCluster draws a random FirstJobId to avoid that; a run that still dies in MPI_Init
# is resubmitted once (new job id), as that is not what these tests are about.
_INIT_FLAKE = re.compile(r"Fatal error in internal_Init_thread|MPI_Init_thread\(.*failed")


def _write(path: Path, text: str, executable: bool = False) -> Path:
    path.write_text(text)
    if executable:
        path.chmod(0o755)
    return path


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _diag(cluster, job_id: int, log: Path) -> str:
    return (f"\n--- job {job_id}: {cluster.job_info(job_id)}\n--- job log {log}:\n{_read(log)}"
            f"\n--- daemon logs:\n{cluster.log_tail(15)}")


def submit_mpi_job(cluster, tmp_path: Path, name: str, batch_text: str, *, args=(), options=(),
                   env=None, timeout: float = 120, attempts: int = 2):
    """Write `batch_text` to tmp_path/name.sbatch, submit it, wait for a final state.

    Returns (job_id, state, log_path, seconds from submit to final state). The job log
    (stdout+stderr, --open-mode=append) is tmp_path/name-<jobid>.log. A run that died in
    MPI_Init (see _INIT_FLAKE) is submitted again, up to `attempts` times in all.
    """
    script = _write(tmp_path / f"{name}.sbatch", batch_text, executable=True)
    for attempt in range(1, attempts + 1):
        t0 = time.monotonic()
        job_id = cluster.sbatch(script, *args, env=env, options=[
            f"--output={tmp_path}/{name}-%j.log", "--open-mode=append", f"--job-name={name}",
            *options])
        state = cluster.wait(job_id, timeout=timeout)
        elapsed = time.monotonic() - t0
        log = tmp_path / f"{name}-{job_id}.log"
        if attempt < attempts and _INIT_FLAKE.search(_read(log)):
            print(f"{name}: job {job_id} died in MPI_Init; resubmitting")
            continue
        return job_id, state, log, elapsed
    raise AssertionError("unreachable")


# ---------------------------------------------------------------------- (a) allreduce

ALLREDUCE = """\
import json, os, sys
from mpi4py import MPI

comm = MPI.COMM_WORLD
total = comm.allreduce(comm.rank + 1, op=MPI.SUM)
rec = {"rank": comm.rank, "size": comm.size, "sum": total,
       "procid": os.environ.get("SLURM_PROCID"), "job": os.environ.get("SLURM_JOB_ID"),
       "ucx": os.environ.get("UCX_NET_DEVICES")}
with open(os.path.join(sys.argv[1], f"rank{comm.rank}.json"), "w") as f:
    json.dump(rec, f)
"""

RUN_MPI_BATCH = """\
#!/bin/bash
#SBATCH --ntasks=2
#SBATCH --time=2
# usage: sbatch this.sbatch PYTHON SCRIPT [ARGS...]
py=$1; shift
srun --mpi=pmi2 --kill-on-bad-exit=1 "$py" -m mpi4py "$@"
"""


def test_allreduce_job_completes(slurm_cluster, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    prog = _write(tmp_path / "allreduce.py", ALLREDUCE)
    job_id, state, log, elapsed = submit_mpi_job(
        slurm_cluster, tmp_path, "allreduce", RUN_MPI_BATCH, args=[PY, str(prog), str(out)],
        timeout=90)
    assert state == "COMPLETED", _diag(slurm_cluster, job_id, log)
    recs = [json.loads(_read(out / f"rank{r}.json") or "null") for r in (0, 1)]
    assert all(recs), f"missing rank output: {recs}" + _diag(slurm_cluster, job_id, log)
    for r, rec in enumerate(recs):
        assert rec["rank"] == r and rec["size"] == 2, rec  # one 2-rank world, not 2 singletons
        assert rec["sum"] == 1 + 2, rec
        assert rec["procid"] == str(r) and rec["job"] == str(job_id), rec
        assert rec["ucx"] == "lo", rec


# --------------------------------------------------------------- (b) a failing rank

RAISES = """\
from mpi4py import MPI

comm = MPI.COMM_WORLD
comm.Barrier()  # both ranks are up
print(f"rank {comm.rank} ready", flush=True)
if comm.rank == 1:
    raise RuntimeError("deliberate failure on rank 1")
comm.recv(source=1)  # never satisfied: rank 0 hangs unless the job is torn down
"""

# Same, but rank 1 vanishes without mpi4py's abort-on-exception: only srun's
# --kill-on-bad-exit can end rank 0.
HARD_EXIT = """\
import os
from mpi4py import MPI

comm = MPI.COMM_WORLD
comm.Barrier()
print(f"rank {comm.rank} ready", flush=True)
if comm.rank == 1:
    print("deliberate failure on rank 1", flush=True)
    os._exit(3)
comm.recv(source=1)
"""

RUN_PLAIN_BATCH = """\
#!/bin/bash
#SBATCH --ntasks=2
#SBATCH --time=2
py=$1; shift
srun --mpi=pmi2 --kill-on-bad-exit=1 "$py" "$@"
"""


@pytest.mark.parametrize("mode", ["exception", "hard_exit"])
def test_failing_rank_fails_job_fast(slurm_cluster, tmp_path, mode):
    prog, batch = {"exception": (RAISES, RUN_MPI_BATCH),
                   "hard_exit": (HARD_EXIT, RUN_PLAIN_BATCH)}[mode]
    prog = _write(tmp_path / "fail.py", prog)
    job_id, state, log, elapsed = submit_mpi_job(
        slurm_cluster, tmp_path, f"fail-{mode}", batch, args=[PY, str(prog)], timeout=90)
    text = _read(log)
    assert state == "FAILED", _diag(slurm_cluster, job_id, log)
    assert "deliberate failure on rank 1" in text, _diag(slurm_cluster, job_id, log)
    assert elapsed < 30, f"took {elapsed:.1f}s" + _diag(slurm_cluster, job_id, log)


# ------------------------------------------------------- (c) time-limit signal + requeue

# Run 0 waits for USR1 (relayed by srun), agrees on the stop with an allreduce (like a
# trainer between steps), and exits REQUEUE_EXIT. Run 1 checks SLURM_RESTART_COUNT.
STOPPABLE = f"""\
import os, signal, sys, time
from mpi4py import MPI

got = []
signal.signal(signal.SIGUSR1, lambda signum, frame: got.append(signum))
comm = MPI.COMM_WORLD
restart = os.environ.get("SLURM_RESTART_COUNT", "0")
def mark(msg):
    print(f"MARK rank={{comm.rank}} size={{comm.size}} restart={{restart}} {{msg}}", flush=True)
mark("start")
if restart == "0":
    while not comm.allreduce(1 if got else 0, op=MPI.MAX):
        time.sleep(0.2)
    mark(f"stopping local_usr1={{len(got)}}")
    comm.Barrier()
    MPI.Finalize()  # both ranks done with MPI before either exits non-zero
    sys.exit({REQUEUE_EXIT})
mark("resumed")
comm.Barrier()
"""

REQUEUE_BATCH = f"""\
#!/bin/bash
#SBATCH --ntasks=2
py=$1; shift
echo "BATCH start restart=${{SLURM_RESTART_COUNT:-0}}"
got_usr1=0
# B:USR1 reaches only this shell; relay it to srun, which passes it to every rank.
trap 'got_usr1=1; echo "BATCH got USR1"; kill -USR1 "$srun_pid" 2>/dev/null' USR1
srun --mpi=pmi2 --kill-on-bad-exit=1 "$py" -m mpi4py "$@" &
srun_pid=$!
# The trap interrupts `wait`; keep waiting until srun is really gone, then collect
# its status (bash remembers it for a later `wait`).
while kill -0 "$srun_pid" 2>/dev/null; do wait "$srun_pid"; done
wait "$srun_pid"; rc=$?
echo "BATCH srun rc=$rc got_usr1=$got_usr1"
# As in slurm/cpu.sbatch: requeue only on the trainer's "stopped, requeue me" code.
if [ "$rc" -eq {REQUEUE_EXIT} ]; then
    scontrol requeue "$SLURM_JOB_ID" && echo "BATCH requeued"
    exit 0
fi
exit "$rc"
"""


def test_signal_then_requeue(slurm_cluster, tmp_path):
    prog = _write(tmp_path / "stoppable.py", STOPPABLE)
    # Slurm keeps time limits in whole minutes and checks them (and --signal) every
    # 30 s, so @55 of 1 min lands 5-35 s in; OverTimeLimit=0, KillWait=3 are in the conf.
    job_id, state, log, elapsed = submit_mpi_job(
        slurm_cluster, tmp_path, "requeue", REQUEUE_BATCH, args=[PY, str(prog)],
        options=["--time=1", "--signal=B:USR1@55", "--requeue"], timeout=150)
    text = _read(log)
    why = _diag(slurm_cluster, job_id, log)
    assert state == "COMPLETED", why
    assert slurm_cluster.job_info(job_id).get("Restarts") == "1", why
    lines = text.splitlines()

    def at(pattern: str) -> int:
        hits = [i for i, ln in enumerate(lines) if re.search(pattern, ln)]
        assert hits, f"no line matching {pattern!r}" + why
        return hits[0]

    # Run 0: the signal arrives, both ranks see it and stop together, srun reports the
    # requeue code, the job requeues; run 1 (same log thanks to --open-mode=append)
    # sees SLURM_RESTART_COUNT=1. Each phase's lines come after the previous phase's.
    phases = [
        [r"^BATCH start restart=0$"],
        [r"^BATCH got USR1$"],
        [rf"^MARK rank={r} size=2 restart=0 stopping local_usr1=[1-9]" for r in (0, 1)],
        [rf"^BATCH srun rc={REQUEUE_EXIT} got_usr1=1$"],
        [r"^BATCH requeued$"],
        [r"^BATCH start restart=1$"],
        [rf"^MARK rank={r} size=2 restart=1 resumed$" for r in (0, 1)],
        [r"^BATCH srun rc=0 got_usr1=0$"],
    ]
    prev = -1
    for phase in phases:
        idx = [at(p) for p in phase]
        assert min(idx) > prev, f"out of order: {phase}" + why
        prev = max(idx)
    assert len(re.findall(r"^BATCH start", text, re.M)) == 2, why
    print(f"signal+requeue job finished in {elapsed:.1f}s")


# ------------------------------------------------------------ hook: zerompi.train

# TODO(lead): drop the env gate once the train CLI is final; add a stop/requeue variant
# (--time=1 --signal=B:USR1@55, large --max_steps, assert "restart 1" and a resumed step).
@pytest.mark.skipif(os.environ.get("ZEROMPI_SLURM_TRAIN") != "1",
                    reason="train-under-Slurm smoke test is opt-in: ZEROMPI_SLURM_TRAIN=1")
@pytest.mark.skipif(importlib.util.find_spec("zerompi.train") is None,
                    reason="zerompi.train not available")
def test_train_cpu_sbatch(slurm_cluster, tmp_path):
    """slurm/cpu.sbatch runs a short zerompi.train to completion under srun."""
    run_dir = tmp_path / "run"
    t0 = time.monotonic()
    job_id = slurm_cluster.sbatch(
        REPO / "slurm" / "cpu.sbatch", "--max_steps", "20", cwd=REPO,
        env={"CONFIG": "configs/tiny.toml", "RUN_DIR": str(run_dir)},
        options=[f"--output={tmp_path}/train-%j.log", "--time=10"])
    state = slurm_cluster.wait(job_id, timeout=400)
    log = tmp_path / f"train-{job_id}.log"
    print(f"train job {state} in {time.monotonic() - t0:.1f}s")
    assert state == "COMPLETED", _diag(slurm_cluster, job_id, log)
    assert (run_dir / "metrics.jsonl").exists(), _diag(slurm_cluster, job_id, log)
