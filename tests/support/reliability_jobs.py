"""Pieces the reliability tests share (tests/system/test_reliability.py, test_watchdog.py):
the hang worker, short `zerompi.train` jobs on a small corpus, and their checks."""
import sys
import time

from mpirun import WORKERS, gone, launch, run_mpi

HANG = str(WORKERS / "hang.py")


TRAIN = [sys.executable, "-m", "zerompi.train"]
FAST = ["--model.preset", "tiny", "--global_batch", "4", "--max_steps", "4", "--warmup_steps", "1",
        "--lr_decay_steps", "20", "--eval_interval", "0", "--checkpoint_interval", "1", "--keep_last", "0",
        "--log_interval", "1", "--progress", "lines", "--zero.stage", "2", "--threads", "1"]


def train(run_dir, corpus, *extra, n=2, timeout=60, env=None, prefix=(), command=TRAIN):
    """`mpiexec -n N python -m zerompi.train` (or `command`, a wrapper around it) with
    stdout and stderr apart."""
    return launch(["mpiexec", "-n", str(n)] + list(prefix) + list(command) + FAST
                  + ["--data", corpus, "--run_dir", str(run_dir)] + list(extra),
                  timeout, env=env, stderr_apart=True)


def one_error(res, code, needle):
    """Exit `code` and the error as one line from rank 0, no traceback."""
    assert res.returncode == code, (res.returncode, res.stdout[-2000:], res.stderr[-3000:])
    assert "Traceback" not in res.stdout + res.stderr, res.stderr[-3000:]
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("zerompi.train: error")]
    assert len(lines) == 1 and needle in lines[0], res.stderr[-3000:]


def stopped_rank_job(tmp_path, mode="stop-self", stage=1, n=4) -> list[str]:
    """hang.py MODE at N ranks, rank N-1 SIGSTOPs itself, timeout_s = 4: what went wrong
    (empty: the job ended with exit 3 within 30 s, a watchdog line named the stopped rank,
    no segfault, and no rank outlived it)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    pidfile = tmp_path / "pid"
    r = run_mpi(n, [HANG, mode, str(stage), str(pidfile)], timeout=60, module=False, check=False)
    out, bad = r.stdout, []
    if r.returncode != 3:
        bad.append(f"exit {r.returncode}, not 3")
    if "not complete after 4 s (zero.comm.timeout_s)" not in out or f"rank {n - 1} did not answer" not in out:
        bad.append(f"no watchdog line naming rank {n - 1}")
    if "at step 4" not in out:  # the step in progress, 1-based as in metrics.jsonl
        bad.append("the line does not name step 4")
    if "Segmentation fault" in out or "Caught signal" in out:
        bad.append("a crash report")
    if r.elapsed >= 30:
        bad.append(f"took {r.elapsed:.1f} s")
    pids = [int(p.read_text()) for p in tmp_path.glob("pid.*") if p.read_text().strip()]
    deadline = time.monotonic() + 5
    while not all(map(gone, pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    if len(pids) != n or not all(map(gone, pids)):
        bad.append(f"ranks left running: {[p for p in pids if not gone(p)]} (of {len(pids)} pid files)")
    return bad + ([out[-3000:]] if bad else [])
