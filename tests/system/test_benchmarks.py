"""Every benchmark of benchmarks/ in a smoke mode: the command its README paragraph gives,
with a tiny model and the fewest runs, end to end (the results JSON, its plot, --replot),
so a change that breaks a benchmark fails here and not on the day someone measures. The
numbers are not checked, only that each part ran and recorded what it should. Also the
shared launcher's kill policy: a driver killed without a word leaves no rank running.

The GPU benchmarks run here the parts a CPU can (bench_gpu_e2e.py: tests/system/
test_bench_gpu_e2e_cpu.py; the acceptance script: test_gpu_acceptance.py)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import types

import pytest
import torch

from mpirun import ROOT, gone, launch, mpi_env

BENCH = ROOT / "benchmarks"
sys.path.insert(0, str(BENCH))


def bench(script: str, *args, timeout: float = 300, rc: int | None = 0, **kw) -> subprocess.CompletedProcess:
    r = launch([sys.executable, str(BENCH / script), *map(str, args)], timeout=timeout, **kw)
    if rc is not None:
        assert r.returncode == rc, r.stdout[-4000:]
    return r


def replotted(script: str, out) -> None:
    """--replot redraws the PNG beside a results JSON from the JSON alone (through the
    script's main, in this process: one interpreter start and matplotlib import less)."""
    import importlib

    png = out.with_suffix(".png")
    png.unlink(missing_ok=True)
    importlib.import_module(script.removesuffix(".py")).main(["--replot", str(out)])
    assert png.stat().st_size > 0


def test_dp(tmp_path):
    out = tmp_path / "dp.json"
    bench("bench_dp.py", "--systems", "zerompi-1", "--models", "tiny", "--nranks", "1", "--warmup", "1",
          "--steps", "1", "--out", out)
    doc = json.loads(out.read_text())
    assert [r["system"] for r in doc["runs"]] == ["zerompi-1"] and not doc["failed"], doc
    assert doc["runs"][0]["step_time_s_median"] > 0
    replotted("bench_dp.py", out)


def test_compare_commits(tmp_path):
    out = tmp_path / "cc.json"
    bench("compare_commits.py", "--before", ROOT, "--after", ROOT, "--quick", "--stages", "1", "--nranks", "1",
          "--repeats", "1", "--steps", "1", "--out", out)
    doc = json.loads(out.read_text())
    assert sorted(r["side"] for r in doc["runs"]) == ["after", "before"] and not doc["failed"], doc
    replotted("compare_commits.py", out)


def test_checkpoint(tmp_path):
    out = tmp_path / "ck.json"
    bench("bench_checkpoint.py", "--model", "tiny", "--vocab", "0", "--ranks", "1", "--repeats", "1", "--warm",
          "--workdir", tmp_path / "work", "--out", out)
    doc = json.loads(out.read_text())
    got = {r["system"]: r for r in doc["results"]}
    assert got["zerompi"]["save_s"] > 0 and got["torch"]["load_s"] > 0, doc
    replotted("bench_checkpoint.py", out)


def test_nodes(tmp_path):
    sys.path.insert(0, str(ROOT / "tests" / "support"))
    from netcluster import available

    ok, why = available()
    if not ok:
        pytest.skip(why)
    out = tmp_path / "nodes.json"
    bench("bench_nodes.py", "--smoke", "--out", out)
    st = json.loads(out.read_text())["runs"][0]["stages"][0]
    # two nodes exchange what the estimator predicts for the mode the engine ran
    assert st["mode_ran"] == "two-level" and abs(st["bytes_ratio"] - 1) < 0.1 and st["replay_matches_step"], st
    replotted("bench_nodes.py", out)


HOST_PROXY = ["--models", "gpt2", "--stages", "0,3", "--steps", "1", "--warmup", "1", "--count-steps", "1",
              "--profile-steps", "1"]


def test_host_proxy(tmp_path):
    """The counts per run at N = 1 and, through mpiexec, N = 2; the plot and --replot."""
    out = tmp_path / "proxy.json"
    bench("bench_host_proxy.py", *HOST_PROXY, "--world", "1,2", "--out", out)
    res = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 0
    m = res["models"]["gpt2"]
    # the real GPT-2's layout in the GPU's 2^26-element buckets: 2 blocks, one unit per
    # block at stage 3 (13 units)
    sig = m["skeleton"]["signatures"]
    assert sig["stage0_n1"] == {"params": 148, "pieces": 149, "blocks": 2, "units": 1, "blocks_per_unit": [2]}
    assert sig["stage3_n2"] == {"params": 148, "pieces": 148, "blocks": 13, "units": 13, "blocks_per_unit": [1] * 13}
    for run in ("torch", "stage0", "stage3"):
        assert m[run]["ops"] > 0 and m[run]["cpu_s"] > 0 and m[run]["python_by_package_us"], run
    # alone nothing is communicated or agreed on; over 2 ranks the buckets and rounds are
    assert m["torch"]["collectives"] == 0 == m["stage0"]["collectives"] == m["stage3"]["collectives"]
    assert m["stage3"]["agreement_rounds"] == 0 < m["n2"]["stage3"]["agreement_rounds"]
    assert m["n2"]["stage0"]["collectives_by_kind"]["all_reduce"] >= 1 and m["n2"]["stage3"]["collectives"] > 0
    replotted("bench_host_proxy.py", out)


def test_host_proxy_without_mpi_says_so_in_one_line(tmp_path):
    r = bench("bench_host_proxy.py", *HOST_PROXY, "--out", tmp_path / "x.json", rc=2, timeout=120,
              env={"MPI4PY_LIBMPI": "/nonexistent/libmpi.so.12"}, stderr_apart=True)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "no working MPI" in lines[0] and "libmpi" in lines[0], r.stderr
    assert not (tmp_path / "x.json").exists()


def test_offload_gpu_runs_its_parts_on_the_cpu(tmp_path):
    out = tmp_path / "offload.json"
    bench("bench_offload_gpu.py", "--device", "cpu", "--preset", "tiny", "--micro", "2", "--seq", "32", "--steps", "1",
          "--out", out, "--delayed", "--capacity", timeout=240)
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
def test_offload_capacity_search_finds_the_boundary(monkeypatch, plain, off, avail, want):
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
    """harness.launch (zerompi/runtime/jobs.py): mpiexec gets SIGTERM when its driver dies."""
    (tmp_path / "sleeper.py").write_text(SLEEPER)
    (tmp_path / "driver.py").write_text(DRIVER)
    marks = tmp_path / "ranks"
    marks.mkdir()
    driver = subprocess.Popen([sys.executable, str(tmp_path / "driver.py"), str(BENCH), str(tmp_path / "sleeper.py"),
                               str(marks)], env=mpi_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
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


def test_compile(tmp_path):
    out = tmp_path / "compile.json"
    bench("bench_compile.py", "--smoke", "--out", out, timeout=300)
    doc = json.loads(out.read_text())
    (r,) = doc["results"]
    assert r["on"]["compile"] and not r["off"]["compile"] and r["on"]["tokens_per_s"] > 0, r
    assert r["max_loss_diff"] == 0.0, r  # aot_eager: the same ops as eager
