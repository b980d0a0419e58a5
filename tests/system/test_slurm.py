"""MPI jobs under a real Slurm: a private one-node cluster on 127.0.0.1 (conftest's
`slurm_cluster`, built by tests/support/slurm_cluster.py). Needs root and .ci/install_debian.sh;
skipped otherwise. The templates in slurm/ are tested in test_slurm_templates.py.

Launch rules these tests pin down (pip MPICH + Slurm 22.05):
  * `srun --mpi=pmi2 --kill-on-bad-exit=1` (pmi2 is the only plugin pip MPICH works with;
    without kill-on-bad-exit a rank that dies can leave the others waiting forever).
  * `--signal=B:USR1@N` signals only the batch shell (measured: srun and the ranks do not
    see it), so the batch script traps it and forwards it to srun, which relays it to
    every rank. Without `B:`, the ranks get it but the batch shell does not.
  * The ranks exit REQUEUE_EXIT after the stop; the batch script then runs
    `scontrol requeue`, and the next run sees SLURM_RESTART_COUNT=1.

"""
from __future__ import annotations

import json
import re

import pytest


from slurm_jobs import PY, REQUEUE_EXIT, _write, _read, _diag, submit_mpi_job

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
    # Echo first: the requeue can kill this shell before scontrol returns.
    echo "BATCH requeueing"
    scontrol requeue "$SLURM_JOB_ID"
    exit 0
fi
exit "$rc"
"""


def test_signal_then_requeue(slurm_cluster, tmp_path):
    prog = _write(tmp_path / "stoppable.py", STOPPABLE)
    # Slurm keeps time limits in whole minutes and checks them (and --signal) every
    # 30 s, sending the signal at the first check within lead + 30 s of the limit: @25 of
    # 1 min lands 5-35 s in (never in the first seconds, before the trap or the ranks'
    # handlers are set). OverTimeLimit=0, KillWait=3 are in the conf.
    job_id, state, log, elapsed = submit_mpi_job(
        slurm_cluster, tmp_path, "requeue", REQUEUE_BATCH, args=[PY, str(prog)],
        options=["--time=1", "--signal=B:USR1@25", "--requeue"], timeout=150)
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
        [r"^BATCH requeueing$"],
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


