"""CPU checks of GPU-path code that reading against CuPy 14 and torch showed would break on
the first GPU run (issue 24): the synchronisation counting of tests/workers/gpu_sync.py,
the NCCL skip decision of the GPU tests, the CuPy stream wrapper, and bench_gpu_e2e's
backend choice, error isolation and freeing of engines. CuPy is faked where needed:
none is installed here."""
from __future__ import annotations

import json
import subprocess
import sys
import types
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from mpirun import WORKERS, mpi_env

sys.path.insert(0, str(WORKERS))
import sync_count  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def fake_cupy(monkeypatch, nccl_available=True, stream_api="from_external"):
    """A cupy whose Device is an immutable type, as CuPy's Cython class is."""
    cupy, cuda = types.ModuleType("cupy"), types.ModuleType("cupy.cuda")
    runtime, nccl = types.ModuleType("cupy.cuda.runtime"), types.ModuleType("cupy.cuda.nccl")
    runtime.deviceSynchronize = lambda: "real sync"
    nccl.available = nccl_available
    cuda.runtime, cuda.nccl, cuda.Device = runtime, nccl, int
    made = []

    class Stream:
        pass

    if stream_api == "from_external":
        Stream.from_external = staticmethod(lambda obj: made.append(("from_external", obj.__cuda_stream__())) or obj)
    cuda.Stream = Stream

    def external(ptr, dev):
        warnings.warn("ExternalStream is deprecated", DeprecationWarning)
        made.append(("ExternalStream", ptr, dev))
    cuda.ExternalStream = external
    cupy.cuda = cuda
    for name, mod in (("cupy", cupy), ("cupy.cuda", cuda), ("cupy.cuda.runtime", runtime),
                      ("cupy.cuda.nccl", nccl)):
        monkeypatch.setitem(sys.modules, name, mod)
    return cupy, made


# ---------------------------------------------------------------- counting syncs in a step

def test_only_events_inside_the_step_range_count():
    from torch.profiler import ProfilerActivity, profile, record_function

    x = torch.ones(8)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        x * 2
        with record_function(sync_count.STEP):
            x * 3
            x * 4
        x * 5
    muls = [e for e in sync_count.inside(prof.events()) if e.name == "aten::mul"]
    assert len(muls) == 2


def test_sync_counts_ignore_the_profilers_own_synchronise():
    def ev(name, lo, hi):
        return SimpleNamespace(name=name, time_range=SimpleNamespace(start=lo, end=hi))
    events = [ev("cudaDeviceSynchronize", 0, 1), ev(sync_count.STEP, 10, 20),
              ev("cudaStreamSynchronize", 12, 13), ev("cudaEventSynchronize", 14, 15),
              ev("cudaDeviceSynchronize", 25, 26)]  # profile.__exit__'s, after the step
    c = sync_count.sync_counts(events)
    assert c == {"syncs": {"cudaStreamSynchronize": 1, "cudaEventSynchronize": 1}, "device_syncs": 0,
                 "ranges": 1}
    events.append(ev("cudaDeviceSynchronize", 16, 17))
    assert sync_count.sync_counts(events)["device_syncs"] == 1


def test_the_device_side_of_the_range_does_not_count():
    """With CUDA activity the range also appears on the device (same name), ending when
    the step's kernels end: the profiler's exit sync inside it is not the step's."""
    from torch.autograd import DeviceType

    def ev(name, lo, hi, dev=DeviceType.CPU):
        return SimpleNamespace(name=name, time_range=SimpleNamespace(start=lo, end=hi), device_type=dev)
    events = [ev(sync_count.STEP, 10, 20), ev(sync_count.STEP, 11, 40, DeviceType.CUDA),
              ev("cudaDeviceSynchronize", 25, 35)]
    assert sync_count.sync_counts(events) == {"syncs": {}, "device_syncs": 0, "ranges": 1}


def test_forbid_device_sync_patches_module_attributes_only(monkeypatch):
    cupy, _ = fake_cupy(monkeypatch)
    real_torch, real_cupy = torch.cuda.synchronize, cupy.cuda.runtime.deviceSynchronize
    with sync_count.forbid_device_sync():  # assigning int.synchronize would raise TypeError
        for fn in (torch.cuda.synchronize, cupy.cuda.runtime.deviceSynchronize):
            with pytest.raises(AssertionError, match="device-wide synchronise"):
                fn()
    assert torch.cuda.synchronize is real_torch and cupy.cuda.runtime.deviceSynchronize is real_cupy


def test_patches_are_undone_before_the_profiler_stops():
    real = torch.cuda.synchronize
    seen = []

    class Profiler:  # torch's profile.__exit__ calls torch.cuda.synchronize
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            seen.append(torch.cuda.synchronize is real)

        def events(self):
            return []

    c = sync_count.profiled(lambda: seen.append(torch.cuda.synchronize is real), Profiler)
    assert seen == [False, True] and c["ranges"] == 0


# ---------------------------------------------------------------- NCCL: the engine's own check

def test_nccl_tests_skip_when_cupy_cannot_load_nccl(monkeypatch):
    from gpu_backend import nccl_skip_reason

    fake_cupy(monkeypatch, nccl_available=False)  # cupy imports: `import cupy` alone said yes
    why = nccl_skip_reason()
    assert why and "cannot load NCCL" in why, why


def test_a_cupy_that_fails_to_import_is_a_reason_not_a_crash(monkeypatch):
    from zerompi.comm.nccl import unavailable

    class Broken(types.ModuleType):
        def __getattr__(self, name):
            raise RuntimeError("CUDA driver version is insufficient")
    monkeypatch.setitem(sys.modules, "cupy", Broken("cupy"))
    monkeypatch.delitem(sys.modules, "cupy.cuda", raising=False)
    why = unavailable("cuda")
    assert why and "cupy cannot be imported" in why and "insufficient" in why, why


# ---------------------------------------------------------------- CuPy stream of torch's stream

@pytest.mark.parametrize("api", ["from_external", "ExternalStream"])
def test_cupy_stream_uses_from_external_where_it_exists(monkeypatch, api):
    from zerompi.kernels.streams import cupy_stream

    cupy, made = fake_cupy(monkeypatch, stream_api=api)
    torch_stream = SimpleNamespace(cuda_stream=0xABC)
    with warnings.catch_warnings():
        warnings.simplefilter("error" if api == "from_external" else "ignore", DeprecationWarning)
        cupy_stream(cupy, torch_stream, 1)
    want = ("from_external", (0, 0xABC)) if api == "from_external" else ("ExternalStream", 0xABC, 1)
    assert made == [want]


def test_fused_optimizer_takes_torchs_stream_without_deprecation(monkeypatch):
    from zerompi.optim.fused_adamw import CupyExecutor

    cupy, made = fake_cupy(monkeypatch)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda dev=None: SimpleNamespace(cuda_stream=77))
    ex = CupyExecutor()
    ex.cupy, ex.dev_id = cupy, 0
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        ex._stream()
    assert made == [("from_external", (0, 77))]


# ---------------------------------------------------------------- bench_gpu_e2e on the CPU

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
         "--stages", "0,3", "--profile-stage", "-1"]


def _bench(tmp_path, *args):
    out = tmp_path / "e2e.json"
    r = subprocess.run([sys.executable, "-c", SPY, str(ROOT / "benchmarks" / "bench_gpu_e2e.py"), *SMALL,
                        "--out", str(out), *args], env=mpi_env(), capture_output=True, text=True, timeout=240)
    assert r.stdout.strip(), r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1]), json.loads(out.read_text())


def test_bench_e2e_backend_mpi_frees_every_engine_and_the_loss_falls(tmp_path):
    run, res = _bench(tmp_path, "--backend", "mpi", "--train-steps", "30")
    assert run["rc"] == 0
    assert run["events"] == ["release", "engine", "release", "engine", "release", "engine", "release"], run
    assert res["stage0"]["backend"] == res["stage3"]["backend"] == "MPICommunicator"
    assert res["stage3"]["tokens_ratio_vs_torch"] > 0
    assert res["train"]["loss_fell"], res["train"]


def test_bench_e2e_nccl_failure_costs_only_the_nccl_numbers(tmp_path):
    run, res = _bench(tmp_path, "--backend", "nccl")
    assert run["rc"] == 1
    assert res["torch_plain"]["tokens_per_s"] > 0
    for s in ("stage0", "stage3"):
        assert "config key 'comm.backend' = 'nccl'" in res[s]["error"], res[s]
