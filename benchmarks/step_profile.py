"""Where one training step's time goes, for bench_gpu_e2e.py: on the device and on the host.

A step can spend its extra time on the host (Python, launches, waits) while its kernels
take as long as plain torch's, which a table of kernels cannot show. A profile holds:
  device_top    the kernels and ops with the most device time
  device_busy   the union of the kernels' intervals over the profiled step's span (well
                under 1: the GPU waited for the host); device_busy_us that union,
                device_kernel_us the kernels' summed durations (more where streams overlap)
  host_top      the ops and CUDA runtime calls with the most host time
  host_waits    the runtime calls that block the host until the device has caught up
                (one cudaDeviceSynchronize of the profile's own ends the step)
  host_runtime  every CUDA runtime and driver call with its count and host time;
                host_totals: counts and host time of all ops, runtime calls and launches
  host_polls    the runtime calls that ask whether the device is done (a host spinning
                on them waits too)
  python_top, python_by_package  cProfile over a few further steps: own time per step by
                function and by package (a C function's counted to the package that
                called it: the host time that is ours)
On the CPU the device rows are empty and the rest is the same, so the dry run checks it.
"""
from __future__ import annotations

import cProfile
import gc
import os
import pstats

import torch

import zerompi

# runtime calls that block the host until the device is done (cudaMemcpy, not its Async
# form), and polls
WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
POLLS = ("cudaEventQuery", "cudaStreamQuery")
CPU = torch.autograd.DeviceType.CPU
RUNTIME = "cu"  # the CUDA runtime's calls and the driver's (CuPy launches through cuLaunchKernel)


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)  # benchmark timing only, never inside the engine


def release(dev: torch.device) -> None:
    """Free what dropped systems held: their reference cycles, and the blocks torch's
    caching allocator keeps (else the next build's free memory excludes them)."""
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)


def _busy_us(events) -> tuple[float, float]:
    """Length of the union of the device events' intervals (streams may overlap), and
    their summed lengths."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    busy, end = 0.0, float("-inf")
    for lo, hi in spans:
        if hi > end:
            busy += hi - max(lo, end)
            end = hi
    return busy, sum(hi - lo for lo, hi in spans)


def _short(path: str) -> str:
    """site-packages/torch/nn/x.py -> torch/nn/x.py; this checkout's zerompi/x.py as is."""
    for mark in ("site-packages" + os.sep, "dist-packages" + os.sep):
        if mark in path:
            return path.split(mark, 1)[1]
    # relative to the checkout that holds the imported zerompi: its folder may itself be
    # named zerompi (a clone), so the first "zerompi/" in the path is not the package
    root = os.path.dirname(os.path.dirname(os.path.abspath(zerompi.__file__))) + os.sep
    return path[len(root):] if path.startswith(root) else path


def _package(path: str) -> str:
    """torch, cupy, ...; zerompi's subpackages apart (zerompi/models is the model, not the engine)."""
    parts = _short(path).split(os.sep)
    return os.sep.join(parts[:2]) if parts[0] == "zerompi" and len(parts) > 2 else parts[0]


def python_top(step, batch, steps: int = 5, top: int = 20) -> tuple[list[dict], dict]:
    """Own (tottime) microseconds per step of the Python functions step() spends most
    in, and of each package (a C function's time to its caller's package)."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step(*batch)
    prof.disable()
    st = pstats.Stats(prof).stats  # {(file, line, name): (cc, nc, tottime, cumtime, callers)}
    rows = sorted(st.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    by_pkg: dict[str, float] = {}
    for (f, _line, _name), (_cc, _nc, tt, _ct, callers) in st.items():
        if f != "~":
            by_pkg[_package(f)] = by_pkg.get(_package(f), 0.0) + tt
            continue
        for (cf, _l, _n), cstats in callers.items():  # a C function: split over its callers
            key = _package(cf) if cf != "~" else "C"
            by_pkg[key] = by_pkg.get(key, 0.0) + cstats[2]
    return ([{"function": f"{_short(f)}:{line}({name})" if f != "~" else name,
              "calls_per_step": nc / steps, "own_us_per_step": tt / steps * 1e6,
              "cum_us_per_step": ct / steps * 1e6}
             for (f, line, name), (_cc, nc, tt, ct, _callers) in rows],
            {k: v / steps * 1e6 for k, v in sorted(by_pkg.items(), key=lambda kv: -kv[1])})


def profile_step(step, batch, dev: torch.device, top: int = 25, cprofile_steps: int = 5) -> dict:
    from torch.profiler import ProfilerActivity, profile

    cuda = dev.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync(dev)
    with profile(activities=acts) as prof:
        step(*batch)
        sync(dev)
    events = prof.events()
    cpu = [e for e in events if e.device_type == CPU]
    span = (max(e.time_range.end for e in cpu) - min(e.time_range.start for e in cpu)) if cpu else 0.0
    avg = prof.key_averages()
    busy, kernel_sum = _busy_us(events)

    def rows(evs, key: str) -> list[dict]:
        return [{"name": e.key, "calls": e.count, "self_us": getattr(e, key)} for e in evs]

    by_dev = sorted(avg, key=lambda e: e.self_device_time_total, reverse=True)[:top] if cuda else []
    # host events only: kernels' names (cutlass..., cudnn...) can start with "cu" too
    on_host = [e for e in avg if getattr(e, "device_type", CPU) == CPU]
    runtime = [e for e in on_host if e.key.startswith(RUNTIME)]
    ops = [e for e in on_host if not e.key.startswith(RUNTIME)]
    launches = [e for e in runtime if "LaunchKernel" in e.key]
    py_top, by_pkg = python_top(step, batch, steps=cprofile_steps)
    return {
        "profiled_step_us": span,
        "device_busy_us": busy,
        "device_kernel_us": kernel_sum,
        "device_busy": busy / span if span and cuda else None,
        "device_top": rows(by_dev, "self_device_time_total"),
        "host_top": rows(sorted(avg, key=lambda e: e.self_cpu_time_total, reverse=True)[:top],
                         "self_cpu_time_total"),
        "host_waits": rows([e for e in avg if e.key.startswith(WAITS) and "Async" not in e.key],
                           "self_cpu_time_total"),
        "host_polls": rows([e for e in avg if e.key.startswith(POLLS)], "self_cpu_time_total"),
        "host_runtime": rows(sorted(runtime, key=lambda e: e.self_cpu_time_total, reverse=True),
                             "self_cpu_time_total"),
        "host_totals": {"ops": sum(e.count for e in ops), "ops_self_us": sum(e.self_cpu_time_total for e in ops),
                        "runtime_calls": sum(e.count for e in runtime),
                        "runtime_self_us": sum(e.self_cpu_time_total for e in runtime),
                        "launches": sum(e.count for e in launches)},  # ops: nested ones counted too
        "python_top": py_top,
        "python_by_package": by_pkg,
    }
