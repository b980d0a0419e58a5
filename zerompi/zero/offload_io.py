"""The staged offload pipeline's copies between the device and host staging, and the
gradient norm where the gradient is (zero/offload.py drives them).

Gradients: each owned block's reduced gradient is copied into the gradient staging as
soon as the reducer has written it (GradReducer.block_done), on a stream of its own
that first waits for the training stream's work so far, so the copy runs while backward
goes on; the step waits once for the last copy, and the training stream waits for them
(no host wait) before the gradients are zeroed.
Parameters: the output staging is cut into upload tiles, each a run that is contiguous
both in the shard and in the device's working parameters (flat_param at stages 0-2,
shard_param at 3); each tile is uploaded on another stream as soon as the host pass has
written it, and the training stream waits for the last upload before the all-gather.
On the CPU the same calls copy at once (no streams): the pipeline's bookkeeping is the
GPU's, which is what the CPU tests check.
Timing: CUDA events around every copy, read (and summed) when phases are asked for.
"""
from __future__ import annotations

import time

import numpy as np
import torch


def upload_tiles(state, tile_elems: int) -> list[tuple[int, int, torch.Tensor]]:
    """(shard_lo, shard_hi, device view) per upload tile: runs of the owned chunks that are
    contiguous both in the shard and in the working parameters, cut at tile_elems."""
    work = state.flat_param if state.replicated else state.shard_param
    runs: list[list[int]] = []  # [shard_lo, device offset, n]
    for ch in sorted(state.own, key=lambda c: c.shard_lo):
        dev = ch.flat_lo if state.replicated else ch.shard_lo
        if runs and runs[-1][0] + runs[-1][2] == ch.shard_lo and runs[-1][1] + runs[-1][2] == dev:
            runs[-1][2] += ch.size
        elif ch.size:
            runs.append([ch.shard_lo, dev, ch.size])
    tiles = []
    for s, d, n in runs:
        for off in range(0, n, tile_elems):
            m = min(tile_elems, n - off)
            tiles.append((s + off, s + off + m, work[d + off:d + off + m]))
    return tiles


class Transfers:
    def __init__(self, state, tile_elems: int):
        self.cuda = state.placement.is_cuda
        grad = state.grad_shard if state.grad_shard is not None else state.flat_grad
        self.blocks = {}  # owned block -> (device gradient of its chunk, shard offset)
        for ch in state.own:
            lo = ch.shard_lo if state.grad_shard is not None else ch.flat_lo
            self.blocks[ch.block] = (grad[lo:lo + ch.size], ch.shard_lo)
        self.tiles = upload_tiles(state, tile_elems)  # (shard_lo, shard_hi, device view)
        self.bounds = [t[0] for t in self.tiles] + [state.owned]
        self.grad_bytes = state.owned * grad.element_size()
        self.param_bytes = state.owned * state.param_dtype.itemsize
        self.timed: dict[str, list] = {"d2h": [], "upload": []}
        if self.cuda:
            dev = state.placement.device
            self.d2h, self.h2d = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
            self.uploaded = [None, None]  # per output slot: the event after its last upload

    # ------------------------------------------------------------ gradients
    def grad_block(self, k: int, staging: torch.Tensor) -> None:
        """Block k's reduced gradient (if this rank owns a chunk of it) -> staging."""
        if k not in self.blocks:
            return
        src, lo = self.blocks[k]
        dst = staging[lo:lo + src.numel()]
        if not self.cuda:
            dst.copy_(src)
            return
        self.d2h.wait_stream(torch.cuda.current_stream(src.device))  # the reducer wrote it there
        with torch.cuda.stream(self.d2h):
            self._timed("d2h", lambda: dst.copy_(src, non_blocking=True))

    def grads_landed(self) -> float:
        """Host wait for every gradient copy issued so far; returns the seconds waited."""
        if not self.cuda:
            return 0.0
        t0 = time.perf_counter()
        self.d2h.synchronize()
        return time.perf_counter() - t0

    def release_grads(self) -> None:
        """The training stream waits for the gradient copies (before it zeroes them)."""
        if self.cuda:
            torch.cuda.current_stream(self.d2h.device).wait_stream(self.d2h)

    # ------------------------------------------------------------ parameters
    def slot_free(self, slot: int) -> None:
        """Host wait until output slot `slot`'s last uploads have read it."""
        if self.cuda and self.uploaded[slot] is not None:
            self.uploaded[slot].synchronize()

    def upload(self, t: int, out: torch.Tensor) -> None:
        """Upload tile t of output staging `out` into the device's working parameters."""
        lo, hi, dst = self.tiles[t]
        if not self.cuda:
            dst.copy_(out[lo:hi])
            return
        if t == 0:  # whatever the training stream queued that reads the parameters comes first
            self.h2d.wait_stream(torch.cuda.current_stream(dst.device))
        with torch.cuda.stream(self.h2d):
            self._timed("upload", lambda: dst.copy_(out[lo:hi], non_blocking=True))

    def uploads_queued(self, slot: int) -> None:
        """After the last tile: the training stream waits for the uploads (no host wait),
        and slot `slot` is marked as being read until they are done."""
        if self.cuda:
            ev = torch.cuda.Event()
            ev.record(self.h2d)
            self.uploaded[slot] = ev
            torch.cuda.current_stream(self.h2d.device).wait_event(ev)

    # ------------------------------------------------------------ timing
    def _timed(self, kind: str, copy) -> None:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        copy()
        b.record()
        self.timed[kind].append((a, b))

    def take_events(self) -> dict[str, list]:
        """The timing events recorded since the last call (a step's), handed over."""
        out, self.timed = self.timed, {"d2h": [], "upload": []}
        return out


def busy_seconds(events: dict[str, list]) -> dict[str, float | None]:
    """Seconds the copy engines spent on each kind of copy; None for a kind whose copies
    are not all done yet (asking never waits for them)."""
    return {kind: (sum(a.elapsed_time(b) for a, b in evs) / 1e3 if all(b.query() for _, b in evs) else None)
            for kind, evs in events.items()}


class DeviceNorm:
    """Weighted sum of squares (+inf on overflow) of the device gradients of the
    optimizer's segments: the table kernels (kernels/adamw_table.py) on torch's current
    stream, one launch pair, no host sync. Needs CuPy (else the engine falls back to
    the optimizer's per-segment norms, also on the device)."""

    def __init__(self, state, segments):
        import cupy

        from ..kernels import adamw_table as kt
        from ..kernels.streams import cupy_stream

        self.cupy, self.kt, self.cupy_stream = cupy, kt, cupy_stream
        shard = state.grad_shard is not None
        grad = state.grad_shard if shard else state.flat_grad
        offs = np.array([s.shard_lo if shard else s.flat_lo for s in segments], np.int64)
        zero = np.zeros_like(offs)
        self.table = kt.build_table([s.length for s in segments], zero, offs, zero)
        kt.check_bounds(self.table, {"grad": grad.numel()})
        self.dev = grad.device
        self.dev_id = self.dev.index if self.dev.index is not None else torch.cuda.current_device()
        with cupy.cuda.Device(self.dev_id), self._stream():
            g = grad.view(torch.int16) if grad.dtype == torch.bfloat16 else grad
            self.grad = cupy.from_dlpack(g)
            self.segs, self.tiles = cupy.asarray(self.table.segs), cupy.asarray(self.table.tiles)
            n = max(1, self.table.ntiles)
            self.scratch = (cupy.empty(n, np.float64), cupy.empty(n, np.int32))
            self.flag = cupy.empty(1, np.int32)
        self.weights, self._key = None, None

    def _stream(self):
        return self.cupy_stream(self.cupy, torch.cuda.current_stream(self.dev_id), self.dev_id)

    def __call__(self, weights) -> torch.Tensor:
        w = np.asarray(weights, np.float64)
        with self.cupy.cuda.Device(self.dev_id), self._stream():
            if w.tobytes() != self._key:  # fixed per run: uploaded once
                self.weights, self._key = self.cupy.asarray(w), w.tobytes()
            res = torch.empty(1, dtype=torch.float64, device=self.dev)
            self.kt.grad_stats_table(self.grad, self.segs, self.tiles, self.weights,
                                     (self.cupy.from_dlpack(res), self.flag), self.scratch)
        return res.view(())
