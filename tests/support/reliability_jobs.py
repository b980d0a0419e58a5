"""Pieces the reliability tests share (tests/system/test_reliability.py, test_watchdog.py):
the hang worker, short `zerompi.train` jobs on a small corpus, and their checks."""
import sys

from mpirun import WORKERS, launch

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
