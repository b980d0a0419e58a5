"""benchmarks/harness.py (zerompi/runtime/jobs.py), the one way benchmarks start jobs: a driver killed without a
chance to clean up (SIGKILL) leaves no rank running."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from mpirun import ROOT, gone, mpi_env

SLEEPER = """import os, sys, time
open(os.path.join(sys.argv[1], f"rank-{os.getpid()}"), "w").close()
time.sleep(600)
"""
DRIVER = """import sys
sys.path.insert(0, sys.argv[1])
from harness import launch
launch(2, [sys.argv[2], sys.argv[3]], timeout=600)
"""


def test_a_sigkilled_driver_leaves_no_rank_running(tmp_path):
    (tmp_path / "sleeper.py").write_text(SLEEPER)
    (tmp_path / "driver.py").write_text(DRIVER)
    marks = tmp_path / "ranks"
    marks.mkdir()
    driver = subprocess.Popen([sys.executable, str(tmp_path / "driver.py"), str(ROOT / "benchmarks"),
                               str(tmp_path / "sleeper.py"), str(marks)], env=mpi_env(),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while len(pids) < 2 and time.monotonic() < deadline and driver.poll() is None:
            pids = [int(p.name.split("-")[1]) for p in marks.iterdir()]
            time.sleep(0.1)
        assert len(pids) == 2, f"the ranks did not start ({pids}, driver exit {driver.poll()})"
        driver.send_signal(signal.SIGKILL)
        driver.wait()
        deadline = time.monotonic() + 30
        while not all(gone(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [p for p in pids if not gone(p)]
        assert not left, f"ranks {left} still run 30 s after their driver was killed"
    finally:
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if driver.poll() is None:
            driver.kill()
            driver.wait()
