"""The host staging buffer of asynchronous saves, and the snapshot copied into it.

A save copies what this rank's file holds into one host buffer, allocated once through
the engine's Placement (device.Placement.host_staging: page-aligned, shareable with a
helper process, page-locked on a GPU) and laid out as the file's datasets are: each
state kind (fp32), the low-precision parameter copy, rank 0's frozen parameters and
buffers. The background writer (rankfile_h5.write_staged) then writes straight from it.

What changes when (so what must be copied before what):
- small things (counters, scaler, AdamW steps, parameter groups, RNG states) and the
  module's buffers (a forward may update them): taken at once, on the training thread;
- the master weights and moments change only in the optimizer update: they are copied
  in the background while the next forward/backward runs, and the engine waits for that
  copy before its next update (fence(); on a GPU the copy runs on a side stream and the
  compute stream waits for it there, without blocking the host).
"""
from __future__ import annotations

import threading
import time

import torch

from ..rankfile_h5 import ALIGN
from ..rankfile_engine import header_of


def _store_dtype(t: torch.Tensor) -> torch.dtype:
    # as writer._storable: 16-bit floats widen to fp32 (exact)
    return torch.float32 if t.dtype in (torch.bfloat16, torch.float16) else t.dtype


def _layout(view, lowp: str | None, mods: list) -> tuple[list, list, int]:
    """(datasets [(kind, elements, byte offset, 'f4' | lowp kind)], module [(name, torch
    dtype, role, shape, numpy dtype, byte offset)], bytes): every region starts on an
    ALIGN boundary, so it can go to disk with O_DIRECT."""
    end = 0

    def take(nbytes: int) -> int:
        nonlocal end
        start = -(-end // ALIGN) * ALIGN
        end = start + nbytes
        return start

    n = view.exported_elements()
    datasets = [(kind, n, take(4 * n), "f4") for kind in view.state_kinds]
    if lowp:
        datasets.append((lowp, n, take(2 * n), lowp))
    module = []
    if view.dims.world.rank == 0:
        for name, t, role in mods:
            store = _store_dtype(t)
            size = t.numel() * torch.empty(0, dtype=store).element_size()
            module.append((name, str(t.dtype).replace("torch.", ""), role, list(t.shape),
                           torch.empty(0, dtype=store).numpy().dtype.str, take(size)))
    return datasets, module, end


class Staging:
    """One rank's staging buffer; reused by every save of the engine (reallocated only
    if what a checkpoint holds changes shape, e.g. a buffer that was resized)."""

    def __init__(self, view, lowp: str | None, mods: list):
        self.datasets, self.module, self.nbytes = _layout(view, lowp, mods)
        self.lowp = lowp
        self.placement = view.placement
        self.mem, self.fd = self.placement.host_staging(self.nbytes)
        self.array = self.mem.numpy()
        self.stream = torch.cuda.Stream(self.placement.device) if self.placement.is_cuda else None

    def fits(self, view, lowp: str | None, mods: list) -> bool:
        return lowp == self.lowp and _layout(view, lowp, mods) == (self.datasets, self.module, self.nbytes)

    def view(self, off: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        size = torch.empty(0, dtype=dtype).element_size()
        return self.mem[off:off + numel * size].view(dtype)

    def close(self) -> None:
        import os

        if self.placement.is_cuda:
            from torch.cuda._pin_memory_utils import unpin_memory

            unpin_memory(self.mem.data_ptr())
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class Snapshot:
    """One save's copy of this rank's state in `staging`. The constructor takes the small
    state and the buffers now and starts the device copies; copy() (the save's thread)
    does the host copies; fence() (the training thread, before the engine changes its
    state) waits for them; finish() (the save's thread) completes the low-precision copy."""

    def __init__(self, staging: Staging, view, tag: str, mods: list):
        state = view.export_state(views=True)
        self.header = header_of(view, tag, state)
        self.summary = self.header.pop("summary")
        self.elements = self.header.pop("elements")
        self.job = {"header": self.header, "module": staging.module, "datasets": staging.datasets}
        self.staging, self.host, device, later = staging, [], [], []
        self.fence_s, self.copied = 0.0, threading.Event()
        regions = {kind: off for kind, _, off, _ in staging.datasets}
        for kind in view.state_kinds:
            pos = regions[kind]
            for t in state["tensors"][kind]:
                pair = (staging.view(pos, t.numel(), torch.float32), t.reshape(-1))
                (device if t.is_cuda else self.host).append(pair)
                pos += 4 * t.numel()
        tensors = {name: t for name, t, _ in mods}
        for name, _, role, shape, _, off in staging.module:
            t = tensors[name]
            dst = staging.view(off, t.numel(), _store_dtype(t))
            if role == "buffer":
                later.append((dst, t.reshape(-1)))  # a forward may change it: copied now
            else:
                (device if t.is_cuda else self.host).append((dst, t.reshape(-1)))
        self.lowp = None
        if staging.lowp:
            _, n, off, _ = staging.datasets[-1]
            lowp_dtype = torch.bfloat16 if staging.lowp == "param_bf16" else torch.float16
            self.lowp = (staging.view(off, n, lowp_dtype), staging.view(regions["param"], n, torch.float32))
        self.events = []
        if staging.stream is not None:
            current = torch.cuda.current_stream(staging.placement.device)
            for dst, src in later:   # on the compute stream: ordered before the next forward
                dst.copy_(src, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(current)
            self.events.append(ev)
            staging.stream.wait_stream(current)   # the copies see the last update
            with torch.cuda.stream(staging.stream):
                for dst, src in device:
                    dst.copy_(src, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(staging.stream)
            self.events.append(ev)
            self.device_done = ev
        else:
            for dst, src in later:
                dst.copy_(src)
            self.device_done = None

    def copy(self) -> None:
        """Host-to-host copies (the whole state on a CPU run), then release the fence."""
        try:
            for dst, src in self.host:
                dst.copy_(src)
        finally:
            self.copied.set()

    def finish(self) -> None:
        """After copy(): wait for the device copies, then round the low-precision
        parameter copy from the staged fp32 values (as the engine rounds: to nearest)."""
        for ev in self.events:
            ev.synchronize()
        if self.lowp is not None:
            self.lowp[0].copy_(self.lowp[1])

    def fence(self) -> None:
        """Called by the engine before it changes its state (ZeroEngine._fence_state)."""
        if self.device_done is not None:
            torch.cuda.current_stream(self.staging.placement.device).wait_event(self.device_done)
        if self.host:
            t0 = time.perf_counter()
            self.copied.wait()
            self.fence_s = time.perf_counter() - t0

    def module_info(self) -> dict:
        from ..rankfile_h5 import module_entry

        return {name: module_entry(name, shape, dt, td, role)
                for name, td, role, shape, dt, _ in self.staging.module}
