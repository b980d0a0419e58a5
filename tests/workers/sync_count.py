"""Counting the CUDA synchronisations of one training step in a torch.profiler trace.

The profiler itself synchronises the device when it stops (profile.__exit__ calls
torch.cuda.synchronize, which records a real cudaDeviceSynchronize), so counting every
event of the trace would blame the engine for the profiler's own call. Only events
that start inside a `record_function(STEP)` range around the step count.

`forbid_device_sync()` makes Python-level device-wide synchronises raise while the
step runs. It replaces attributes of modules only: CuPy's Device is an immutable
Cython type (assigning Device.synchronize raises TypeError), and Device.synchronize
reaches the runtime through a C call that no Python patch sees; the profiler's count
of cudaDeviceSynchronize catches that one. The patches are undone before the profiler
exits (`profiled`), so its own synchronise runs unpatched.
"""
from __future__ import annotations

import contextlib
import sys
from collections import Counter
from typing import Callable, Iterable

STEP = "zerompi_step"
DEVICE_SYNC = "cudaDeviceSynchronize"


def _forbidden(*_, **__):
    raise AssertionError("device-wide synchronise inside a training step")


def _targets() -> list[tuple[object, str]]:
    """(module, attribute) pairs that synchronise the whole device."""
    import torch

    out = [(torch.cuda, "synchronize")]
    if sys.modules.get("cupy", False) is not None:  # None: import blocked on purpose
        try:
            import cupy
        except ImportError:
            return out
        out.append((cupy.cuda.runtime, "deviceSynchronize"))
    return out


@contextlib.contextmanager
def forbid_device_sync():
    saved = [(obj, name, getattr(obj, name)) for obj, name in _targets()]
    try:
        for obj, name, _ in saved:
            setattr(obj, name, _forbidden)
        yield
    finally:
        for obj, name, fn in saved:
            setattr(obj, name, fn)


def _span(e) -> tuple[float, float]:
    tr = e.time_range
    return tr.start, tr.end


def _host_range(e, range_name: str) -> bool:
    """The host side of a record_function range. With CUDA profiling the trace also holds
    its device side under the same name (kineto's gpu_user_annotation), which lasts
    until the step's kernels finish, past the host range: the profiler's own
    synchronise at exit can fall inside it."""
    from torch.autograd import DeviceType

    return e.name == range_name and getattr(e, "device_type", DeviceType.CPU) == DeviceType.CPU


def inside(events: Iterable, range_name: str = STEP) -> list:
    """Events that start within a host `range_name` range (the ranges themselves
    excluded). By time, not by thread: backward runs partly on autograd's own threads."""
    events = list(events)
    ranges = [_span(e) for e in events if _host_range(e, range_name)]
    return [e for e in events if e.name != range_name
            and any(lo <= _span(e)[0] <= hi for lo, hi in ranges)]


def sync_counts(events: Iterable, range_name: str = STEP) -> dict:
    """Synchronisation calls inside the step: {"syncs": {name: count}, "device_syncs": n,
    "ranges": number of host step ranges found} (0 means nothing was measured)."""
    events = list(events)
    names = Counter(e.name for e in inside(events, range_name) if "Synchronize" in e.name)
    return {"syncs": dict(names), "device_syncs": names.get(DEVICE_SYNC, 0),
            "ranges": sum(_host_range(e, range_name) for e in events)}


def profiled(step: Callable[[], None], profiler: Callable[[], contextlib.AbstractContextManager]) -> dict:
    """Run step() once under profiler(), inside the STEP range and forbid_device_sync();
    the patches are undone before the profiler stops. Returns sync_counts."""
    from torch.profiler import record_function

    with profiler() as prof:
        with forbid_device_sync(), record_function(STEP):
            step()
    return sync_counts(prof.events())
