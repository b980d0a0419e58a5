"""benchmarks/gpu_acceptance/run.sh (and its forwarder benchmarks/gpu_acceptance.sh), checked on a CPU before it ever meets a GPU (issues 24, 39):
the --dry-run end to end (GPUs hidden, the GPU tests skip with their reasons, the e2e
benchmarks run the tiny preset on the CPU, MPI installed from a wheel folder because
mpi4py is made to load none, a stand-in deepspeed wheel installed by the peers step and
seen by the e2e steps alone), a budget that cuts the run off, and the launch cap and
interrupt handling of tests/support/mpirun.py that the script relies on.

The build-tests step (nvcc/NVRTC compiles, ~40 s here) is in the script's default --skip:
the same tests run in the suite itself (tests/unit/test_kernels_build.py)."""
from __future__ import annotations

import base64
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
import zipfile
from pathlib import Path

import pytest

from mpirun import launch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_acceptance" / "run.sh"
FORWARDER = ROOT / "benchmarks" / "gpu_acceptance.sh"  # the command the GPU machine is given
STEPS = ["env-probe", "mpi", "peers", "kernel-tests", "mpi-gpu-tests", "e2e", "e2e-1b", "train-cmd", "proxy",
         "offload", "build-tests"]
FILES = {"acceptance.log", "env.json", "kernels_junit.xml", "mpi_junit.xml", "e2e.json",
         "e2e_1b.json", "host_proxy.json", "offload.json"}
STAND_IN = "stand-in deepspeed of the dry-run test"


@pytest.fixture(scope="module")
def mpich_wheels(tmp_path_factory) -> Path | None:
    d = tmp_path_factory.mktemp("wheels")
    r = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(d), "mpich==5.0.2"],
                       capture_output=True, timeout=300)
    return d if r.returncode == 0 else None


def stand_in_deepspeed_wheel(folder: Path) -> None:
    """A wheel named deepspeed whose import fails saying what it is: the peers step must
    install it and the e2e steps must import it from there."""
    files = {"deepspeed/__init__.py": f"raise ImportError({STAND_IN!r})\n",
             "deepspeed-0.0.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: deepspeed\nVersion: 0.0.0\n",
             "deepspeed-0.0.0.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                                "Tag: py3-none-any\n"}

    def digest(text: str) -> str:
        return base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
    record = "".join(f"{n},sha256={digest(t)},{len(t.encode())}\n" for n, t in files.items())
    files["deepspeed-0.0.0.dist-info/RECORD"] = record + "deepspeed-0.0.0.dist-info/RECORD,,\n"
    with zipfile.ZipFile(folder / "deepspeed-0.0.0-py3-none-any.whl", "w") as z:
        for n, t in files.items():
            z.writestr(n, t)


def _steps(out: Path) -> list[dict]:
    return json.loads((out / "env.json").read_text())["steps"]


def test_dry_run_end_to_end(tmp_path, mpich_wheels):
    out, wheels = tmp_path / "acc", tmp_path / "wheels"
    wheels.mkdir()
    stand_in_deepspeed_wheel(wheels)
    args = ["bash", str(SCRIPT), str(out), "--dry-run", "--commit", "c0ffee", "--wheels", str(wheels)]
    env = {}
    if mpich_wheels is not None:  # the GPU machine's case: mpi4py loads no MPI library
        for w in mpich_wheels.iterdir():
            os.symlink(w, wheels / w.name)
        env["MPI4PY_LIBMPI"] = "/nonexistent/libmpi.so.12"
    r = launch(args, timeout=400, env=env)
    assert r.returncode == 0, r.stdout[-5000:]
    log = (out / "acceptance.log").read_text()
    assert FILES == {p.name for p in out.iterdir()}, sorted(os.listdir(out))
    steps = _steps(out)
    assert [s["step"] for s in steps] == STEPS, steps
    status = {s["step"]: s["status"] for s in steps}
    for name in ("build-tests", "offload"):  # the default --skip; no GPU
        assert status.pop(name) == "skip", steps
    assert set(status.values()) == {"ok"}, steps
    assert all(f"STEP {name} " in log for name in STEPS)
    if mpich_wheels is not None:
        assert "no working MPI: MPICH from" in log and "mpi_from_wheels: MPICH Version" in log, log[-3000:]
    # the summary table ends the log, before the STEP lines
    assert "=== e2e summary" in log and log.count("system             tok/s") == 2, log[-3000:]

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
    e2e = json.loads((out / "e2e.json").read_text())
    sy = e2e["systems"]
    want = ["torch", "fsdp2", "stage0", "stage1", "stage2", "stage3", "deepspeed2", "deepspeed3"]
    assert list(sy) == want and e2e["train"]["loss_fell"], e2e
    assert all(sy[n]["ratio_vs_torch"]["median"] > 0 and "python_by_package" in sy[n]["profile"]
               for n in want[1:6]), sy
    try:
        import deepspeed  # noqa: F401  where it is installed, the stand-in is not used
    except ImportError:
        assert all(STAND_IN in sy[n]["skipped"] for n in ("deepspeed2", "deepspeed3")), sy
        assert "peers: ImportError: " + STAND_IN in log
    e2e_1b = json.loads((out / "e2e_1b.json").read_text())["systems"]
    assert list(e2e_1b) == ["torch", "stage3"] and all("profile" in v for v in e2e_1b.values()), e2e_1b


def test_a_cut_off_run_keeps_the_probe_and_reports_every_step(tmp_path):
    """A budget far too small: the probe runs, later steps do not start once less than
    their minimum is left, every step still reports, and the run ends within the budget
    (plus the 15 s kill grace it keeps)."""
    out = tmp_path / "acc"
    t0 = time.monotonic()
    launch(["bash", str(FORWARDER), str(out), "--dry-run", "--budget", "30", "--skip", "mpi"], timeout=200)
    assert time.monotonic() - t0 < 30 + 15
    steps = _steps(out)
    assert [s["step"] for s in steps] == STEPS, steps
    assert steps[0]["status"] == "ok" and "torch" in json.loads((out / "env.json").read_text()), steps
    # 30 s: the probe (minimum 10 s of the 15 s left after the kill grace) runs, no later step
    # (minimum 20 s) starts; every step that did not run says why
    assert {s["step"] for s in steps if "budget" in s["detail"]} >= {"kernel-tests", "e2e", "e2e-1b"}, steps
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
