"""Crash safety of checkpoints: SIGKILL in the middle of saves (one rank, many times; a
whole 2-rank job), after which the latest checkpoint verifies and loads. Damaged
checkpoints: tests/multirank/test_checkpoint_faults.py."""
import json
import os
import random
import signal
import subprocess
import sys
import time

from mpirun import ROOT, WORKERS, mpi_env, run_mpi
from zerompi.checkpoint import verify_checkpoint


def test_crash_single_rank_many_kills(tmp_path):
    """20 saves SIGKILLed at random moments (uniform in 0-0.35 s of a train+save loop
    that rotates with keep_last=2): after every kill DIR/latest verifies (sha256) and
    names at least the last save the child reported, and the next child loads it."""
    env = mpi_env({"PYTHONPATH": os.pathsep.join([str(ROOT), str(WORKERS)])})
    out = tmp_path / "log.json"
    p = subprocess.run([sys.executable, str(WORKERS / "ckpt_crash.py"), "--dir", str(tmp_path / "ck"),
                        "--out", str(out), "--fork", "20", "--seed", "1", "--max-delay", "0.35"],
                       env=env, capture_output=True, text=True, timeout=170, start_new_session=True)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    log = json.loads(out.read_text())
    assert len(log) == 20
    # The kills did land inside saves: some left a partial .tmp-* behind.
    assert any(t["leftovers"] for t in log), log
    verify_checkpoint(tmp_path / "ck")


def test_crash_two_ranks(tmp_path):
    """SIGKILL of a whole 2-rank job (its process group, like a node failure or scancel)
    at a random moment after its first save, i.e. inside a later save; the next job
    loads and verifies the latest checkpoint and its successful save cleans up."""
    ck = str(tmp_path / "ck")
    args = [str(WORKERS / "ckpt_crash.py"), "--dir", ck, "--mpi"]
    rng = random.Random(2)
    for trial in range(3):
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
