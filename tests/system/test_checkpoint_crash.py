"""Crash safety of checkpoints: SIGKILL in the middle of saves (one rank, many times; a
whole 2-rank job; one rank of two during background writes), synchronous and
asynchronous, after which the latest checkpoint verifies and loads. Damaged
checkpoints: tests/multirank/test_checkpoint_faults.py."""
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mpirun import ROOT, WORKERS, mpi_env, run_mpi
from zerompi.checkpoint import verify_checkpoint
from zerompi.checkpoint import naming


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_crash_single_rank_many_kills(tmp_path, mode):
    """20 saves SIGKILLed at random moments (uniform in 0-0.35 s of a train+save loop
    that rotates with keep_last=2): after every kill DIR/latest verifies (checksums) and
    names at least the last save the child reported, and the next child loads it.
    async: one background save per step (a write is nearly always in flight); also every
    visible checkpoint verifies and latest names a save that was begun: the kill of the
    only rank, i.e. of all ranks, never lets an unpublished checkpoint be loaded."""
    env = mpi_env({"PYTHONPATH": os.pathsep.join([str(ROOT), str(WORKERS)])})
    out = tmp_path / "log.json"
    p = subprocess.run([sys.executable, str(WORKERS / "ckpt_crash.py"), "--dir", str(tmp_path / "ck"),
                        "--out", str(out), "--fork", "20", "--seed", "1", "--max-delay", "0.35"]
                       + (["--async"] if mode == "async" else []),
                       env=env, capture_output=True, text=True, timeout=170, start_new_session=True)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    log = json.loads(out.read_text())
    assert len(log) == 20
    # The kills did land inside saves: some left a partial .tmp-* behind (async: most,
    # since a background write is in flight nearly all the time).
    hit = sum(bool(t["leftovers"]) for t in log)
    assert hit >= (10 if mode == "async" else 1), log
    verify_checkpoint(tmp_path / "ck")


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_crash_two_ranks(tmp_path, mode):
    """SIGKILL of a whole 2-rank job (its process group, like a node failure or scancel)
    at a random moment after its first save, i.e. inside a later save (async: inside a
    background write; 5 jobs); the next job loads and verifies the latest checkpoint and
    its successful save cleans up."""
    ck = str(tmp_path / "ck")
    args = [str(WORKERS / "ckpt_crash.py"), "--dir", ck, "--mpi"] + (["--async"] if mode == "async" else [])
    rng = random.Random(2)
    for trial in range(5 if mode == "async" else 3):   # async: 20 + 5 + 6 kill trials in this file
        cmd = ["mpiexec", "-n", "2", sys.executable, "-m", "mpi4py"] + args
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env=mpi_env(), start_new_session=True)
        seen = []
        try:
            deadline = time.monotonic() + 120
            while not (seen and seen[-1].startswith("saved")) and time.monotonic() < deadline:
                line = p.stdout.readline()
                assert line or p.poll() is None, "worker exited early:\n" + "".join(seen)
                seen.append(line)
            assert seen[-1].startswith("saved"), "".join(seen)
            time.sleep(rng.uniform(0.0, 0.6))
        finally:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
            # hydra's proxy starts the ranks in a process group of their own: kill them by
            # their command line too, as a node failure would, before the next job looks
            while subprocess.run(["pkill", "-9", "-f", ck], capture_output=True).returncode == 0:
                time.sleep(0.05)
        ready = next(ln for ln in seen if ln.startswith("ready"))
        assert trial == 0 or ready.split()[1] != "0", seen  # resumed from the previous job's save
        verify_checkpoint(ck)
    out = run_mpi(2, args + ["--once"], timeout=120)
    assert "ready" in out.stdout and "saved" in out.stdout
    assert not [e for e in os.listdir(ck) if e.startswith(".")]  # a good save cleans up


def test_sigkill_of_one_rank_during_background_writes(tmp_path):
    """One rank of a 2-rank job SIGKILLs itself at a random moment (a node failure) while
    a background save is nearly always in flight (one per step): 6 jobs, rank 0 and rank
    1 each with writer thread and process; the launcher ends the job. Each time the previous checkpoint
    verifies, every visible one does, latest is not older than the last save reported
    published, and the next job resumes from it."""
    ck = tmp_path / "ck"
    base = [str(WORKERS / "ckpt_crash.py"), "--dir", str(ck), "--mpi", "--async"]
    run_mpi(2, base + ["--once"], timeout=120)
    hits = 0
    kills = [(1, "thread"), (0, "process"), (1, "process"), (0, "thread"), (1, "thread"), (0, "process")]
    for trial, (rank, writer) in enumerate(kills):
        before = verify_checkpoint(ck)["client_state"]["data_step"]
        res = run_mpi(2, base + ["--writer", writer, "--kill-rank", str(rank), "--seed", str(trial),
                                 "--max-delay", "0.6"], timeout=120, check=False)
        assert res.returncode != 0, res.stdout[-3000:]
        lines = res.stdout.splitlines()
        assert f"ready {before}" in lines, res.stdout[-3000:]   # resumed from what latest named
        saved = [ln.split()[1] for ln in lines if ln.startswith("saved")]
        m = verify_checkpoint(ck)
        for e in os.listdir(ck):
            if not e.startswith(".") and (ck / e).is_dir():
                verify_checkpoint(ck / e)
        assert not saved or m["counters"]["global_steps"] >= int(saved[-1].split("-")[1]), (saved, m["tag"])
        hits += any(e.startswith(naming.TMP_PREFIX) for e in os.listdir(ck))
    assert hits >= 1   # some kill landed inside a background write
    t0 = time.monotonic()   # no writer helper outlived its rank (PR_SET_PDEATHSIG)
    while _orphan_writers():
        assert time.monotonic() - t0 < 10, f"checkpoint writer processes outlived their ranks: {_orphan_writers()}"
        time.sleep(0.1)


def _orphan_writers() -> list[int]:
    """Writer helpers whose rank (the last argument) is gone; other tests' live ones are not."""
    found = subprocess.run(["pgrep", "-f", "zerompi.checkpoint.background.helper"], capture_output=True, text=True)
    orphans = []
    for pid in found.stdout.split():
        try:
            parent = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[-2].decode()
        except (OSError, IndexError):
            continue  # gone meanwhile
        if not Path(f"/proc/{parent}").exists():
            orphans.append(int(pid))
    return orphans
