"""benchmarks/bench_gpu_e2e.py run on the CPU in a process of its own (one MPI rank), as
benchmarks/gpu_acceptance.sh runs it on a GPU: the backend choice, a failing backend
costing only its own numbers, and every engine freed (issue 24; the GPU-path checks
that run in this process: tests/unit/test_gpu_readiness.py)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from mpirun import mpi_env

ROOT = Path(__file__).resolve().parents[2]
SPY = """
import importlib.util, json, sys
sys.path.insert(0, sys.argv[1].rsplit("/", 1)[0])  # as `python benchmarks/x.py` would
spec = importlib.util.spec_from_file_location("bench", sys.argv[1])
b = importlib.util.module_from_spec(spec); spec.loader.exec_module(b)
events, init, release = [], b.zerompi.initialize, b.release
b.zerompi.initialize = lambda *a, **k: events.append("engine") or init(*a, **k)
b.release = lambda dev: events.append("release") or release(dev)
rc = b.main(sys.argv[2:])
print(json.dumps({"rc": rc, "events": events}))
"""

SMALL = ["--device", "cpu", "--preset", "tiny", "--micro", "2", "--seq", "32", "--warmup", "1", "--steps", "1",
         "--stages", "0,3", "--profile-stages", "none"]


def _bench(tmp_path, *args):
    out = tmp_path / "e2e.json"
    r = subprocess.run([sys.executable, "-c", SPY, str(ROOT / "benchmarks" / "bench_gpu_e2e.py"), *SMALL,
                        "--out", str(out), *args], env=mpi_env(), capture_output=True, text=True, timeout=240)
    assert r.stdout.strip(), r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1]), json.loads(out.read_text())


def test_bench_e2e_backend_mpi_frees_every_engine_and_the_loss_falls(tmp_path):
    run, res = _bench(tmp_path, "--backend", "mpi", "--train-steps", "30", "--profile-stages", "3")
    assert run["rc"] == 0
    assert run["events"] == ["release", "engine", "release", "engine", "release", "engine", "release"], run
    assert res["stage0"]["backend"] == res["stage3"]["backend"] == "MPICommunicator"
    assert res["stage3"]["tokens_ratio_vs_torch"] > 0
    assert res["train"]["loss_fell"], res["train"]
    # the host-side profile (step_profile.py) of plain torch and of the profiled stage only;
    # the engine's own Python time is told apart from the model's and torch's
    assert "profile" not in res["stage0"]
    plain, ours = res["torch_plain"]["profile"], res["stage3"]["profile"]
    for p in (plain, ours):
        assert p["profiled_step_us"] > 0 and p["host_top"] and p["python_top"], p
        assert p["device_top"] == [] and p["device_busy"] is None  # no device on the CPU
        assert p["python_by_package"].get("zerompi/models", 0) > 0  # the model's forward
    assert "zerompi/zero" not in plain["python_by_package"]
    assert ours["python_by_package"]["zerompi/zero"] > 0  # the engine's hooks and step


def test_bench_e2e_nccl_failure_costs_only_the_nccl_numbers(tmp_path):
    run, res = _bench(tmp_path, "--backend", "nccl")
    assert run["rc"] == 1
    assert res["torch_plain"]["tokens_per_s"] > 0
    for s in ("stage0", "stage3"):
        assert "config key 'comm.backend' = 'nccl'" in res[s]["error"], res[s]
