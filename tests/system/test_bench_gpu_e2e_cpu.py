"""benchmarks/bench_gpu_e2e.py on the CPU (issues 24, 39, 40), as gpu_acceptance.sh runs it
on a GPU: the interleaved rounds (order reversed every other round, ratios to plain torch
per round, groups, a failing or skipped system, a build out of memory retried in a new
group) with stand-in systems on a fake clock in this process; then the real systems
(plain torch, FSDP2 over gloo, zerompi stages, DeepSpeed where it imports) in a process of
its own (one MPI rank): their records, profiles and calibration inputs, the same losses
whether built beside others or alone, and a failing backend costing only its own numbers."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mpirun import mpi_env

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_gpu_e2e as bench  # noqa: E402
from e2e_systems import System  # noqa: E402
from zerompi.models.gpt import PRESETS  # noqa: E402

COST = {"torch": 1.0, "stage0": 0.5, "stage1": 0.25, "stage2": 0.5}  # seconds a step on the fake clock
DRIFT = [1.0, 3.0, 1.5, 2.5]  # the machine's speed in round r (batch r of the pool), changing a lot


class Clock:
    t = 0.0

    def perf_counter(self) -> float:
        return self.t


def fake_run(tmp_path, monkeypatch, spec: str, rounds: int = 4, oom_once=(), fail_at=None):
    """Run.run over stand-in systems: the step order, and what each system's record holds."""
    clock, log, closed, ooms, runs = Clock(), [], [], set(oom_once), []

    def build(name, cfg, micro, backend, dev):
        if name == "stage3":
            return {"skipped": "not here"}
        if name in ooms:
            ooms.discard(name)
            raise torch.cuda.OutOfMemoryError("stand-in")
        calls = []

        def step(x, y):
            calls.append(1)
            if fail_at and name == fail_at[0] and len(calls) == fail_at[1]:
                raise RuntimeError("stand-in failure")
            clock.t += COST[name] * DRIFT[next(i for i, b in enumerate(runs[0].pool) if b[0] is x)]
            log.append(name)
            return torch.tensor(1.0)
        s = System(name, step, {"kind": "stand-in"})
        s.close = lambda: closed.append(name)
        return s
    monkeypatch.setattr(bench, "build", build)
    monkeypatch.setattr(bench, "time", clock)
    a = argparse.Namespace(micro=2, seq=8, warmup=1, rounds=rounds, steps=1, profile="none", profile_steps=1,
                           peak_flops=0.0, backend="mpi")
    result = {}
    runs.append(bench.Run(a, PRESETS["tiny"], torch.device("cpu"), tmp_path / "e2e.json", result))
    runs[0].run(bench.parse_groups(spec))
    return result, log, closed


def test_rounds_reverse_the_order_and_ratios_pair_blocks_of_the_same_round(tmp_path, monkeypatch):
    res, log, closed = fake_run(tmp_path, monkeypatch, "stage0,stage3/stage1")
    # warm-ups, then A B, B A, A B, B A; then the next group with plain torch timed again
    assert log == ["torch", "stage0"] + ["torch", "stage0", "stage0", "torch"] * 2 + \
        ["stage1"] + ["torch", "stage1", "stage1", "torch"] * 2, log
    assert res["groups"] == [["torch", "stage0"], ["torch", "stage1"]]
    sy = res["systems"]
    # the speed changed 3x between rounds, not within one: each round's ratio is exact
    for name, want in (("stage0", 2.0), ("stage1", 4.0)):
        r = sy[name]["ratio_vs_torch"]
        assert r["rounds"] == pytest.approx([want] * 4) and r["median"] == sy[name]["tokens_ratio_vs_torch"], r
        assert sy[name]["groups"] == [0 if name == "stage0" else 1]
        assert sy[name]["rounds_step_s"] == pytest.approx([COST[name] * d for d in DRIFT])
    assert sy["torch"]["groups"] == [0, 1] and len(sy["torch"]["rounds_step_s"]) == 8
    assert sy["stage3"] == {"skipped": "not here"}
    assert closed == ["stage0", "stage1", "torch"]  # each group freed, plain torch last
    assert json.loads((tmp_path / "e2e.json").read_text())["systems"]["stage1"]["step_s"] > 0


def test_a_failing_system_costs_its_own_numbers_and_an_oom_build_moves_to_a_new_group(tmp_path, monkeypatch):
    res, log, closed = fake_run(tmp_path, monkeypatch, "stage0,stage2,stage1", oom_once=("stage1",),
                                fail_at=("stage2", 3))
    sy = res["systems"]
    assert sy["stage2"]["error"] == "RuntimeError: stand-in failure" and len(sy["stage2"]["rounds_step_s"]) == 4
    assert sy["stage2"]["rounds_step_s"][0] is not None and sy["stage2"]["rounds_step_s"][2] is None
    assert "stage2" in closed and log.count("stage2") == 2  # its warm-up and round 0; round 1 failed
    assert res["groups"] == [["torch", "stage0", "stage2"], ["torch", "stage1"]]  # stage1 retried
    assert "error" not in sy["stage1"] and len(sy["stage1"]["ratio_vs_torch"]["rounds"]) == 4
    assert "error" not in sy["stage0"] and sy["stage0"]["ratio_vs_torch"]["median"] > 0


def test_a_gpu_group_ends_when_the_free_memory_is_short(tmp_path, monkeypatch):
    GiB = 1 << 30
    run = bench.Run(argparse.Namespace(micro=2, seq=8, profile="none"), PRESETS["tiny"], torch.device("cpu"),
                    tmp_path / "x.json", {})
    run.cuda, run.built = True, {"torch": None, "stage0": None}
    run.result["systems"] = {"torch": {"peak_memory_bytes": 8 * GiB}, "stage0": {"peak_memory_bytes": 10 * GiB}}
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda dev: 5 * GiB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda dev: 2 * GiB)
    for free, fits in ((12 * GiB, True), (11 * GiB, False)):  # need 1.25 x 10 + 2 = 14.5 GiB, cached 3
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev, f=free: (f, 80 * GiB))
        assert run.fits() is fits
    run.built = {"torch": None}  # nothing that could be freed: build anyway
    assert run.fits()


SPY = """
import importlib.util, json, sys
sys.path.insert(0, sys.argv[1].rsplit("/", 1)[0])  # as `python benchmarks/x.py` would
spec = importlib.util.spec_from_file_location("bench", sys.argv[1])
b = importlib.util.module_from_spec(spec); spec.loader.exec_module(b)
print(json.dumps({"rc": b.main(sys.argv[2:])}))
"""
SMALL = ["--device", "cpu", "--preset", "tiny", "--micro", "2", "--seq", "32", "--warmup", "1", "--rounds", "2",
         "--steps", "1", "--profile-steps", "1"]


def _bench(tmp_path, *args, name="e2e.json"):
    out = tmp_path / name
    r = subprocess.run([sys.executable, "-c", SPY, str(ROOT / "benchmarks" / "bench_gpu_e2e.py"), *SMALL,
                        "--out", str(out), *args], env=mpi_env(), capture_output=True, text=True, timeout=240)
    assert r.stdout.strip(), r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])["rc"], json.loads(out.read_text())


def test_real_systems_side_by_side_train_as_they_do_alone_and_are_profiled(tmp_path):
    rc, res = _bench(tmp_path, "--backend", "mpi", "--systems", "fsdp2,stage0,stage3", "--train-steps", "30")
    assert rc == 0
    sy = res["systems"]
    assert list(sy) == ["torch", "fsdp2", "stage0", "stage3"] and res["groups"] == [list(sy)]
    assert sy["fsdp2"]["backend"] == "gloo" and sy["stage3"]["backend"] == "MPICommunicator"
    for name, rec in sy.items():
        assert rec["tokens_per_s"] > 0 and len(rec["rounds_step_s"]) == 2, (name, rec)
        p = rec["profile"]  # every system profiled (--profile all)
        assert p["profiled_step_us"] > 0 and p["host_top"] and p["python_top"], p
        assert p["device_top"] == [] and p["device_busy"] is None and p["device_kernel_us"] == 0  # no device
        assert p["host_totals"]["ops"] > 0 and p["host_totals"]["launches"] == 0, p["host_totals"]
        assert p["python_by_package"].get("zerompi/models", 0) > 0  # the model's forward
        cal = res["calibration"][name]
        assert cal["step_s"] == rec["step_s"] and cal["host_python_us"] > 0
    assert "ratio_vs_torch" not in sy["torch"] and len(sy["stage3"]["ratio_vs_torch"]["rounds"]) == 2
    assert "zerompi/zero" not in sy["torch"]["profile"]["python_by_package"]
    assert sy["stage3"]["profile"]["python_by_package"]["zerompi/zero"] > 0  # the engine's hooks and step
    assert res["train"]["loss_fell"], res["train"]
    # built beside three others or alone, stage 3 takes the same steps on the same batches
    rc, alone = _bench(tmp_path, "--backend", "mpi", "--systems", "stage3", "--profile", "none",
                       name="alone.json")
    assert rc == 0 and alone["systems"]["stage3"]["loss"] == sy["stage3"]["loss"], (alone, sy["stage3"])
    assert alone["systems"]["torch"]["loss"] == sy["torch"]["loss"]


def test_bench_e2e_nccl_failure_costs_only_the_nccl_numbers(tmp_path):
    rc, res = _bench(tmp_path, "--backend", "nccl", "--systems", "stage0,stage3", "--profile", "none")
    assert rc == 1
    sy = res["systems"]
    assert sy["torch"]["tokens_per_s"] > 0
    for s in ("stage0", "stage3"):
        assert "config key 'comm.backend' = 'nccl'" in sy[s]["error"], sy[s]


def test_deepspeed_in_a_group_of_its_own(tmp_path):
    """Where deepspeed imports (not on the CI machine; the GPU script carries its wheels):
    ZeRO-2/3 over gloo, after the others, with plain torch timed again beside them."""
    pytest.importorskip("deepspeed", exc_type=ImportError)
    rc, res = _bench(tmp_path, "--backend", "mpi", "--systems", "stage0/deepspeed2,deepspeed3", "--profile", "none")
    assert rc == 0, res
    assert res["groups"] == [["torch", "stage0"], ["torch", "deepspeed2", "deepspeed3"]]
    for s in ("deepspeed2", "deepspeed3"):
        assert res["systems"][s]["ratio_vs_torch"]["median"] > 0 and res["systems"][s]["deepspeed"], res["systems"][s]
