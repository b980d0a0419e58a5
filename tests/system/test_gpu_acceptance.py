"""benchmarks/gpu_acceptance.sh, checked on a CPU before it ever meets a GPU (issue 24):
the --dry-run end to end (GPUs hidden, the GPU tests skip with their reasons, the e2e
benchmarks run the tiny preset on the CPU, MPI installed from a wheel folder because
mpi4py is made to load none), a budget that cuts the run off, and the launch cap and
interrupt handling of tests/support/mpirun.py that the script relies on.

The build-tests step (nvcc/NVRTC compiles, ~40 s here) is skipped with --skip: the
same tests run in the suite itself (tests/unit/test_kernels_build.py)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from mpirun import launch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_acceptance.sh"
STEPS = ["env-probe", "mpi", "kernel-tests", "kernel-bench", "mpi-gpu-tests", "e2e", "train-cmd", "build-tests",
         "e2e-1b"]
FILES = {"acceptance.log", "env.json", "kernels_junit.xml", "kernels_bench.json", "mpi_junit.xml", "e2e.json",
         "build_junit.xml", "e2e_1b.json"}


@pytest.fixture(scope="module")
def mpich_wheels(tmp_path_factory) -> Path | None:
    d = tmp_path_factory.mktemp("wheels")
    r = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(d), "mpich==5.0.2"],
                       capture_output=True, timeout=300)
    return d if r.returncode == 0 else None


def _steps(out: Path) -> list[dict]:
    return json.loads((out / "env.json").read_text())["steps"]


def test_dry_run_end_to_end(tmp_path, mpich_wheels):
    out = tmp_path / "acc"
    args = ["bash", str(SCRIPT), str(out), "--dry-run", "--skip", "build-tests", "--commit", "c0ffee"]
    env = {}
    if mpich_wheels is not None:  # the GPU machine's case: mpi4py loads no MPI library
        args += ["--wheels", str(mpich_wheels)]
        env["MPI4PY_LIBMPI"] = "/nonexistent/libmpi.so.12"
    r = launch(args, timeout=400, env=env)
    assert r.returncode == 0, r.stdout[-5000:]
    log = (out / "acceptance.log").read_text()
    assert FILES - {"build_junit.xml"} == {p.name for p in out.iterdir()}, sorted(os.listdir(out))
    steps = _steps(out)
    assert [s["step"] for s in steps] == STEPS, steps
    status = {s["step"]: s["status"] for s in steps}
    assert status.pop("kernel-bench") == "skip" and status.pop("build-tests") == "skip", steps
    assert set(status.values()) == {"ok"}, steps
    assert all(f"STEP {name} " in log for name in STEPS)
    if mpich_wheels is not None:
        assert "no working MPI: MPICH from" in log and "mpi_from_wheels: MPICH Version" in log, log[-3000:]

    env_probe = json.loads((out / "env.json").read_text())
    assert env_probe["decide"]["gpu"] is False and env_probe["torch"]["cuda_available"] is False
    assert "swap_data_ptr" in env_probe["torch"] and "resolves_to" in env_probe["host"]
    assert env_probe["zerompi_commit_given"] == "c0ffee" and "(given: c0ffee)" in log  # --commit
    assert "zerompi.train: done, 20 steps" in log and "train-cmd device: cpu" in log, log[-3000:]
    # nothing failed, and what needs the GPU skipped saying why (the NCCL dtype check
    # runs where cupy is installed, test_device's binding on the CPU too)
    for junit, n_gpu in (("kernels_junit.xml", 18), ("mpi_junit.xml", 10)):
        cases = list(ET.parse(out / junit).iter("testcase"))
        assert not [c for c in cases if c.find("failure") is not None or c.find("error") is not None], junit
        why = [c.find("skipped").get("message", "") for c in cases if c.find("skipped") is not None]
        assert len(why) >= n_gpu and all("CUDA" in w or "cupy" in w for w in why), (junit, why)
    assert json.loads((out / "kernels_bench.json").read_text()) == {"skipped": "no CUDA device visible"}
    e2e = json.loads((out / "e2e.json").read_text())
    assert all(e2e[f"stage{s}"]["tokens_per_s"] > 0 for s in (0, 3)) and e2e["train"]["loss_fell"], e2e
    assert e2e["stage3_slots8"]["tokens_per_s"] > 0 and "python_by_package" in e2e["stage3_slots8"]["profile"]
    assert "stage2_offload" in json.loads((out / "e2e_1b.json").read_text())


def test_a_cut_off_run_keeps_the_probe_and_reports_every_step(tmp_path):
    """A budget far too small: the probe runs, later steps do not start once less than
    their minimum is left, every step still reports, and the run ends within the budget
    (plus the 15 s kill grace it keeps)."""
    out = tmp_path / "acc"
    t0 = time.monotonic()
    launch(["bash", str(SCRIPT), str(out), "--dry-run", "--budget", "30", "--skip", "mpi"], timeout=200)
    assert time.monotonic() - t0 < 30 + 15
    steps = _steps(out)
    assert [s["step"] for s in steps] == STEPS, steps
    assert steps[0]["status"] == "ok" and "torch" in json.loads((out / "env.json").read_text()), steps
    # 30 s: the probe (minimum 10 s of the 15 s left after the kill grace) runs, no later step
    # (minimum 20 s) starts; every step that did not run says why
    assert {s["step"] for s in steps if "budget" in s["detail"]} >= {"build-tests", "e2e-1b"}, steps
    assert all(s["status"] == "skip" and s["detail"] for s in steps[1:]), steps


def test_launch_cap_lowers_every_timeout(monkeypatch):
    monkeypatch.setenv("ZEROMPI_TEST_LAUNCH_CAP", "1")
    t0 = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match="timeout after 1.0s"):
        launch(["sleep", "30"], timeout=600)
    assert time.monotonic() - t0 < 15


def test_an_interrupted_launch_leaves_no_process(tmp_path):
    """`timeout -s INT` around pytest interrupts it; the launched job is a session of its
    own (the signal misses it), so launch() must kill it."""
    pid_file = tmp_path / "pid"

    def interrupt_once_started():
        t0 = time.monotonic()
        while not pid_file.exists() and time.monotonic() - t0 < 60:
            time.sleep(0.05)
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGINT)
    # Python ignores SIGINT when started with it ignored (a background job of a script):
    # the default handler for this test, as under a terminal or `timeout -s INT`
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Thread(target=interrupt_once_started, daemon=True).start()
        with pytest.raises(KeyboardInterrupt):
            launch(["bash", "-c", f"sleep 60 & echo $! > {pid_file}; wait"], timeout=120)
    finally:
        signal.signal(signal.SIGINT, old)
    pid = int(pid_file.read_text())
    # killed is enough: where PID 1 does not reap orphans (containers), it stays a zombie
    deadline = time.monotonic() + 5
    while _running(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _running(pid), pid


def _running(pid):
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")
