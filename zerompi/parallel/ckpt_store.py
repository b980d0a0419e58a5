"""Where a checkpointed block's input waits between its forward and its backward
(activations.py decides when; this module decides where and how).

- Pa (partition): the input is replicated over the tensor-parallel group, so each tp
  rank keeps only its 1/tp slice of the flattened input (padded to a multiple of tp);
  before recomputation the slices are all-gathered over tp (counted here and by the
  tp Communicator's own stats).
- cpu offload: the kept slice is copied into host memory after the forward and brought
  back for the backward (on a GPU: pinned host memory, the host->device copy on a side
  stream; on the CPU: a real copy into a separate host buffer and back).
- contiguous: kept slices live in one persistent flat buffer per dtype (an Arena),
  allocated on the first step and reused, so long-lived checkpoints do not interleave
  with short-lived activations in the allocator.
"""
from __future__ import annotations

import weakref

import torch

from ..device import Placement
from ..runtime.console import say

ALIGN_BYTES = 256  # every slice of an arena starts on a 256-byte boundary (CUDA's allocator's)


def _aligned(numel: int, dtype: torch.dtype) -> int:
    per = max(1, ALIGN_BYTES // torch.empty(0, dtype=dtype).element_size())
    return -(-numel // per) * per


class Arena:
    """One flat buffer per dtype on one placement, bump-allocated within a forward pass
    and reset when no kept slice is alive any more (the next pass). Sized on the first
    request as `slots` x that slice (one slice per checkpointed block); a pass that
    needs more takes plain tensors for the excess, and the arena grows to the measured
    need at the next reset (logged)."""

    def __init__(self, placement: Placement, name: str, slots: int, log):
        self.placement, self.name, self.slots, self.log = placement, name, max(1, slots), log
        self.buffers: dict[torch.dtype, torch.Tensor] = {}
        self.used: dict[torch.dtype, int] = {}
        self.need: dict[torch.dtype, int] = {}   # elements this pass asked for
        self.grown = 0                           # times a buffer was enlarged

    def reset(self) -> None:
        for dt, need in self.need.items():
            buf = self.buffers.get(dt)
            if buf is not None and need > buf.numel():
                self.log(f"activation_checkpointing.contiguous: {self.name} arena for {dt} grows "
                         f"from {buf.numel()} to {need} elements (a pass needed more than the first)")
                self.buffers[dt] = None  # free before allocating the larger one
                self.buffers[dt] = self.placement.empty(need, dt)
                self.grown += 1
        self.used = {dt: 0 for dt in self.buffers}
        self.need = {}

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
        """A slice of `numel` elements, or None when the arena is full (use a plain tensor)."""
        n = _aligned(numel, dtype)
        self.need[dtype] = self.need.get(dtype, 0) + n
        buf = self.buffers.get(dtype)
        if buf is None:
            buf = self.buffers[dtype] = self.placement.empty(self.slots * n, dtype)
            self.used[dtype] = 0
        at = self.used[dtype]
        if at + n > buf.numel():
            return None
        self.used[dtype] = at + n
        return buf[at:at + numel]

    def reserved_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values() if b is not None)


class Counters:
    """Kept checkpoint bytes (current and peak, device and host) and Pa's gather traffic."""

    def __init__(self) -> None:
        self.kept = {"device": 0, "host": 0}
        self.peak = {"device": 0, "host": 0}
        self.gather_calls = self.gather_elements = self.gather_bytes = 0
        self.checkpoints = self.recomputed = 0

    def add(self, where: str, nbytes: int) -> None:
        self.kept[where] += nbytes
        self.peak[where] = max(self.peak[where], self.kept[where])


class Saved:
    """One checkpointed call's kept input: states kept -> restoring -> restored -> released."""

    def __init__(self, store: "Store", x: torch.Tensor, prev: "Saved | None"):
        self.store, self.shape, self.dtype, self.numel = store, x.shape, x.dtype, x.numel()
        self.device = x.device
        self.prev = weakref.ref(prev) if prev is not None else None
        self.state = "kept"
        self.full = self.handle = self.event = None
        tp = store.tp_size if store.partition else 1
        self.n = -(-self.numel // tp) if self.numel else 0   # elements per tp rank
        flat = x.detach().reshape(-1)
        lo = min(store.tp_rank * self.n, self.numel) if tp > 1 else 0
        piece = flat[lo:lo + self.n]
        self.where = "host" if store.offload else "device"
        arena = store.arenas.get(self.where)
        keep = arena.take(self.n, self.dtype) if arena is not None else None
        self.version = None
        if keep is None and tp == 1 and self.where == "device" and x.is_contiguous():
            keep, self.version = piece, x._version   # plain checkpointing: a reference, no copy
        elif keep is None:
            keep = store.placements[self.where].empty(self.n, self.dtype)
        if self.version is None:
            keep[:piece.numel()].copy_(piece, non_blocking=store.cuda)
            if piece.numel() < self.n:
                keep[piece.numel():].zero_()   # padding of the last tp rank
        self._x = x if self.version is not None else None  # for the in-place check only
        self.keep = keep
        self.nbytes = self.n * keep.element_size()
        store.counters.add(self.where, self.nbytes)
        store.counters.checkpoints += 1
        store.live += 1

    def start_restore(self) -> None:
        """Bring the slice back to the device and start its all-gather (non-blocking)."""
        if self.state != "kept":
            return
        st = self.store
        piece = self.keep
        if self.where == "host":
            if st.cuda:
                side = st.side_stream()
                side.wait_stream(torch.cuda.current_stream(self.device))  # the D2H copy is done
                with torch.cuda.stream(side):
                    piece = torch.empty(self.n, dtype=self.dtype, device=self.device)
                    piece.copy_(self.keep, non_blocking=True)
                    self.event = torch.cuda.Event()
                    self.event.record(side)
            else:
                piece = torch.empty(self.n, dtype=self.dtype, device=self.device).copy_(self.keep)
        if st.partition and st.tp_size > 1:
            if self.event is not None:
                # An MPI communicator reads the buffer from the host's point of view: the
                # slice's copy must be complete (1/tp of the input; the gather overlaps).
                self.event.synchronize()
            full = torch.empty(self.n * st.tp_size, dtype=self.dtype, device=self.device)
            self.handle = st.tp.all_gather(piece, full, async_op=True)
            c = st.counters
            c.gather_calls += 1
            c.gather_elements += full.numel()
            c.gather_bytes += full.numel() * full.element_size()
        else:
            full = piece
        self.full = full
        self.state = "restoring"

    def finish_restore(self) -> torch.Tensor:
        """The block's input, full and on the device (waits for the prefetch if any)."""
        if self.state == "released":
            raise RuntimeError("activation checkpointing: backward through a checkpoint whose kept input "
                               "was already used (backward twice through the same graph needs "
                               "retain_graph, which checkpointing does not support)")
        if self._x is not None and self._x._version != self.version:
            raise RuntimeError("activation checkpointing: a checkpointed block's input was modified in "
                               "place after the block ran; its recomputation would differ")
        self.start_restore()
        if self.handle is not None:
            self.handle.wait()
            self.handle = None
        if self.event is not None and self.store.cuda:
            torch.cuda.current_stream(self.device).wait_event(self.event)
            self.full.record_stream(torch.cuda.current_stream(self.device))
            self.event = None
        self.state = "restored"
        return self.full[:self.numel].view(self.shape)

    def release(self) -> None:
        if self.state == "released":
            return
        if self.handle is not None:
            self.handle.wait()  # never leave a receive outstanding into a freed buffer
            self.handle = None
        self.state = "released"
        self.keep = self.full = self._x = None
        st = self.store
        st.counters.kept[self.where] -= self.nbytes
        st.live -= 1

    def __del__(self):  # the graph was dropped without a backward
        try:
            self.release()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


class Store:
    """Keeps the inputs of checkpointed blocks (see the module docstring)."""

    def __init__(self, tp, placement: Placement, partition: bool, offload: bool, contiguous: bool,
                 slots: int, log):
        self.tp, self.tp_size, self.tp_rank = tp, tp.size, tp.rank
        self.partition, self.offload, self.contiguous = partition, offload, contiguous
        self.cuda = placement.is_cuda
        dev = Placement(placement.device)
        host = Placement(torch.device("cpu"), pinned=self.cuda)  # pinned: async copies to/from a GPU
        self.placements = {"device": dev, "host": host}
        self.arenas: dict[str, Arena] = {}
        if contiguous:
            where = "host" if offload else "device"
            self.arenas[where] = Arena(self.placements[where], where, slots, log)
        self.counters = Counters()
        self.live = 0
        self._side = None

    def side_stream(self):
        if self._side is None:
            self._side = torch.cuda.Stream()
        return self._side

    def begin_pass(self) -> None:
        """A new forward pass: the arenas restart when nothing kept is alive."""
        if self.live == 0:
            for a in self.arenas.values():
                a.reset()


def log_rank0(msg: str) -> None:
    """One line on stderr from world rank 0 (or from a process without MPI)."""
    say(msg)
