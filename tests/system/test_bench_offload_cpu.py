"""benchmarks/bench_offload_gpu.py on the CPU (a check of the script the GPU runs, one
process of its own), its capacity search with the engine runs stood in, and
bench_offload_host.py at a small size."""
from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from mpirun import mpi_env

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))


def test_offload_gpu_bench_runs_its_parts_on_the_cpu(tmp_path):
    out = tmp_path / "offload.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_offload_gpu.py"), "--device", "cpu",
                        "--preset", "tiny", "--micro", "2", "--seq", "32", "--steps", "1", "--out", str(out),
                        "--delayed", "--capacity"], env=mpi_env(), capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["failed"] == [] and res["offload"]["optimizer"] == "HostPassAdamW"
    ph = res["offload"]["phases"]
    assert ph["host_pass"] > 0 and ph["threads"] >= 1 and not ph["delayed"]
    assert res["delayed"]["phases"]["delayed"] and res["delayed_batch"].startswith("micro 2 x gas ")
    assert res["capacity"] == {"skipped": "the capacity probe needs a GPU"}
    assert set(res["accept"]) == {"offload_step_s<=0.8", "peak_gpu_gb<=11.7", "delayed<=1.2x_plain"}


@pytest.mark.parametrize("plain,off,avail,want", [
    (4e9, 8e9, 120e9, ("gpt-4b", "gpt-4b", "GPU memory", "host memory")),
    (2e9, 8e9, 120e9, ("gpt-1b", "gpt-4b", "GPU memory", "host memory")),
    (7e9, 30e9, 400e9, ("gpt-6.7b", "gpt-20b", "GPU memory", "the ladder's end")),
])
def test_capacity_search_finds_the_boundary(monkeypatch, plain, off, avail, want):
    """Models above a limit fail with CUDA's out-of-memory error; the search reports the
    largest that fits and why the next did not, without trying what host memory forbids."""
    import bench_offload_gpu as b
    from zerompi.models.gpt import count_params

    tried = []

    def run(cfg, small, dev, offload):
        n = count_params(cfg)
        tried.append((offload, n))
        assert not offload or 16 * n <= 0.85 * avail  # never tried beyond host memory
        if n > (off if offload else plain):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory.")
        return {"step_s": 1.0}
    monkeypatch.setattr(b, "run", run)
    monkeypatch.setattr(b, "release", lambda dev: None)
    monkeypatch.setattr(b, "mem_info", lambda: {"MemAvailable": avail})
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev: types.SimpleNamespace(total_memory=141e9))
    r = b.capacity(torch.device("cuda"), 60, {"plain": {"gpt-1b": True}, "offload": {"gpt-1b": True}})
    p, o = r["modes"]["plain"], r["modes"]["offload"]
    assert (p["largest"], o["largest"]) == want[:2]
    assert p["limit"].startswith(want[2]) and o["limit"].startswith(want[3])
    assert len(tried) <= 6  # from the prediction, not the whole ladder (2 x 6)


def test_offload_host_bench_writes_its_record(tmp_path):
    out = tmp_path / "host.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_offload_host.py"), "--elements", "2e5",
                        "--threads", "1", "--repeat", "1", "--out", str(out)], env=mpi_env(),
                       capture_output=True, text=True, timeout=240)
    res = json.loads(out.read_text())
    assert r.returncode in (0, 1), r.stderr[-2000:]
    row = res["rows"][0]
    assert row["threads"] == 1 and row["copy_GBps"] > 0 and row["torch_GBps"] > 0
    assert ("pass_GBps" in row) == res["compiled"] and out.with_suffix(".png").is_file()
