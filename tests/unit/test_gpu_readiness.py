"""CPU checks of GPU-path code that reading against CuPy 14 and torch showed would break on
the first GPU run (issue 24): the synchronisation counting of tests/workers/gpu_sync.py,
the NCCL skip decision of the GPU tests and the CuPy stream wrapper (bench_gpu_e2e's
backend choice, error isolation and freeing of engines, run on the CPU:
tests/system/test_bench_gpu_e2e_cpu.py). CuPy is faked where needed: none is installed here."""
from __future__ import annotations

import sys
import types
import warnings
from types import SimpleNamespace

import pytest
import torch

from mpirun import WORKERS

sys.path.insert(0, str(WORKERS))
import sync_count  # noqa: E402


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
