"""MPI collectives on GPU tensors through constant-size pinned host buffers, for an MPI
that is not CUDA-aware (pip's MPICH; device.cuda_aware_mpi() says which).

A collective over device tensors is cut into chunks that fit one staging slot. Two
slots (default 4 MiB each) alternate, and the copies run on a side stream:

    pack 0 | pack 1  MPI 0  unpack 0 | pack 2  MPI 1  unpack 1 | ...

Chunk k+1 is copied device -> host (on the side stream) before MPI moves chunk k, so
the copy overlaps the transfer; unpack k (host -> device) is queued behind it and
overlaps MPI k+1. Slot reuse needs no extra synchronisation: every copy runs on the one
side stream in issue order, and the host waits for chunk k's pack (an event recorded
after every earlier copy, unpacks included) before MPI touches slot k % 2. At the end
torch's current stream waits for the side stream (no host or device synchronise).

The copy functions are a Copier (CUDACopier on a GPU, HostCopier on CPU tensors), so
the chunking and the pipeline are tested on CPU with CPU tensors standing in for device
memory (tests/workers/comm_staged.py). Staged collectives complete before they return
(async_op=True gives a finished handle): overlapping them with compute would need a
progress thread. Results equal the unstaged MPICommunicator's: bitwise for data
movement and the 'ordered' sum (all-to-all + rank-order sum on the device), within
rounding for 'native' sums (MPI picks its algorithm by message size, and chunks are
smaller messages). gather() (stage 3's full_state_dict, a set-up path) is
staged the same way; every collective of the Communicator protocol that takes tensors
is overridden here (tests/multirank/test_comm_gpu.py checks that none is left to mpi.py, which
refuses device tensors).
"""
from __future__ import annotations

import time
from typing import Any, Callable

import torch

from ..runtime.watchdog import waiting
from .base import DoneHandle
from .mpi import MPICommunicator, MPIIN, buffer_spec, check_reducible, ordered_sum

SLOT_BYTES = 4 << 20


class HostCopier:
    """Copies on the host, done when issued: CPU tensors standing in for device memory."""

    def alloc(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def begin(self) -> None: ...

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def mark(self) -> Any:
        return None

    def sync(self, mark: Any) -> None: ...

    def end(self) -> None: ...


class CUDACopier(HostCopier):
    """Pinned host slots; copies on a side stream ordered after torch's current stream."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device)

    def alloc(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def begin(self) -> None:
        # the producers of the send buffers (and the last readers of the receive
        # buffers) are on torch's current stream
        self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)

    def mark(self) -> Any:
        ev = torch.cuda.Event()
        ev.record(self.stream)
        return ev

    def sync(self, mark: Any) -> None:
        mark.synchronize()  # host waits for this event only, not the device

    def end(self) -> None:
        # consumers on the current stream run after the last unpack; tensors freed by
        # the caller are reused by the current stream only after it, so no record_stream
        torch.cuda.current_stream(self.device).wait_stream(self.stream)


class Stager:
    """Double-buffered chunk pipeline over two constant-size host slots."""

    def __init__(self, copier: HostCopier, slot_bytes: int = SLOT_BYTES):
        if slot_bytes < 8 or slot_bytes % 8:
            raise ValueError(f"staging slot of {slot_bytes} bytes: must be a positive multiple of 8")
        self.copier, self.slot_bytes = copier, slot_bytes
        self._slots: list[torch.Tensor] | None = None
        self.trace: list[tuple[str, int, int]] | None = None  # (step, chunk, slot) when a list

    def slot(self, i: int, dtype: torch.dtype) -> torch.Tensor:
        if self._slots is None:
            self._slots = [self.copier.alloc(self.slot_bytes) for _ in range(2)]
        return self._slots[i].view(dtype)

    def chunk(self, per_unit: int, dtype: torch.dtype) -> int:
        """Elements per chunk when a chunk of m needs per_unit * m slot elements."""
        m = self.slot_bytes // (per_unit * torch.empty(0, dtype=dtype).element_size())
        if m < 1:
            raise ValueError(f"staging slot of {self.slot_bytes} bytes cannot hold one "
                             f"element per rank ({per_unit} x {dtype})")
        return m

    def run(self, nchunks: int, plan: Callable[[int, torch.Tensor], tuple]) -> None:
        """plan(k, slot) -> (pack, mpi, unpack): pack and unpack are lists of (dst, src)
        copies (device -> slot, slot -> device), mpi() moves chunk k inside the slot."""
        if nchunks == 0:
            return
        cp, marks, jobs = self.copier, {}, {}

        def pack(k: int) -> None:
            jobs[k] = plan(k, self._slot_of(k))
            for dst, src in jobs[k][0]:
                cp.copy(dst, src)
            marks[k] = cp.mark()
            self._note("pack", k)

        cp.begin()
        pack(0)
        for k in range(nchunks):
            if k + 1 < nchunks:
                pack(k + 1)  # overlaps MPI k below
            cp.sync(marks.pop(k))
            _, mpi, unpack = jobs.pop(k)
            self._note("mpi", k)
            mpi()
            for dst, src in unpack:
                cp.copy(dst, src)
            self._note("unpack", k)
        cp.end()

    def _slot_of(self, k: int) -> int:
        return k % 2

    def _note(self, step: str, k: int) -> None:
        if self.trace is not None:
            self.trace.append((step, k, k % 2))


def _span(n: int, m: int, k: int) -> tuple[int, int]:
    return k * m, min(n, (k + 1) * m)


def _chunks(n: int, m: int) -> int:
    return -(-n // m)


def _flat(t: torch.Tensor | None, name: str) -> torch.Tensor | None:
    """The chunking slices elements: callers also pass n-D tensors (frozen weights,
    buffers), which MPI takes as they are."""
    if t is None:
        return None
    if not t.is_contiguous():
        raise ValueError(f"{name}: tensor must be contiguous")
    return t.view(-1)


class StagedMPICommunicator(MPICommunicator):
    """MPICommunicator whose collectives stage CUDA tensors through host slots; CPU
    tensors take the unstaged path unchanged. `stage_cpu=True` (tests) stages CPU
    tensors too, with `copier` (default HostCopier) standing in for the device copies."""

    def __init__(self, comm: Any = None, reduce_scatter: str = "ordered", _dup: bool = True,
                 device: "torch.device | str | None" = None, slot_bytes: int = SLOT_BYTES,
                 copier: HostCopier | None = None, stage_cpu: bool = False):
        super().__init__(comm, reduce_scatter=reduce_scatter, _dup=_dup)
        self.device = None if device is None else torch.device(device)
        if copier is None:
            copier = CUDACopier(self.device) if self.device is not None and self.device.type == "cuda" \
                else HostCopier()
        self.stager = Stager(copier, slot_bytes)
        self.stage_cpu = stage_cpu

    @property
    def carries_gpu_tensors(self) -> bool:
        return self.device is not None and self.device.type == "cuda"

    def _from_split(self, sub) -> "StagedMPICommunicator":
        c = StagedMPICommunicator(sub, self.algorithm, _dup=False, device=self.device,
                                  slot_bytes=self.stager.slot_bytes, copier=self.stager.copier,
                                  stage_cpu=self.stage_cpu)
        c.stager = self.stager  # one pair of slots per process: groups never run at once
        return c

    def _staged(self, *ts) -> bool:
        return self.size > 1 and all(isinstance(t, torch.Tensor) for t in ts) and \
            (self.stage_cpu or any(t.device.type == "cuda" for t in ts))

    def _mpi_call(self, op: str, fn: Callable[[], None]) -> None:
        with waiting(op):
            fn()

    def _timed(self, op: str, body: Callable[[], None], async_op: bool):
        t0 = time.perf_counter()
        body()
        self._stats.add_time(op, time.perf_counter() - t0)
        return DoneHandle() if async_op else None

    # ------------------------------------------------------------ staged building blocks
    def _s_all_to_all(self, send: torch.Tensor, recv: torch.Tensor, op: str) -> None:
        N, n = self.size, send.numel() // self.size
        m = self.stager.chunk(2 * N, send.dtype)

        def plan(k, s):
            a, b = _span(n, m, k)
            w = b - a
            buf = self.stager.slot(s, send.dtype)
            hs, hr = buf[:N * w], buf[N * m:N * m + N * w]
            pack = [(hs[q * w:(q + 1) * w], send[q * n + a:q * n + b]) for q in range(N)]
            unpack = [(recv[q * n + a:q * n + b], hr[q * w:(q + 1) * w]) for q in range(N)]
            return pack, lambda: self._mpi_call(op, lambda: self.comm.Alltoall(buffer_spec(hs, op), buffer_spec(hr, op))), unpack

        self.stager.run(_chunks(n, m), plan)

    def _s_all_gather(self, send: torch.Tensor, recv, op: str, root: int | None = None) -> None:
        """recv = every rank's send, concatenated; with `root`, on that rank only (Gather)."""
        N, n = self.size, send.numel()
        me = root is None or self.rank == root
        m = self.stager.chunk(N + 1, send.dtype)

        def call(hs, hr):
            if root is None:
                return self.comm.Allgather(buffer_spec(hs, op), buffer_spec(hr, op))
            return self.comm.Gather(buffer_spec(hs, op), buffer_spec(hr, op) if me else None, root=root)

        def plan(k, s):
            a, b = _span(n, m, k)
            w = b - a
            buf = self.stager.slot(s, send.dtype)
            hs, hr = buf[:w], buf[m:m + N * w]
            unpack = [(recv[q * n + a:q * n + b], hr[q * w:(q + 1) * w]) for q in range(N)] if me else []
            return [(hs, send[a:b])], lambda: self._mpi_call(op, lambda: call(hs, hr)), unpack

        self.stager.run(_chunks(n, m), plan)

    # ------------------------------------------------------------ collectives
    def all_to_all(self, send, recv, async_op: bool = False):
        if not self._staged(send, recv):
            return super().all_to_all(send, recv, async_op)
        send, recv = _flat(send, "send"), _flat(recv, "recv")
        if send.numel() != recv.numel() or send.numel() % self.size:
            raise ValueError(f"all_to_all: send has {send.numel()} and recv {recv.numel()} elements; "
                             f"both must be the same multiple of {self.size}")
        self._stats.record("all_to_all", send.numel(), send.element_size())
        return self._timed("all_to_all", lambda: self._s_all_to_all(send, recv, "all_to_all"), async_op)

    def all_gather(self, send, recv, async_op: bool = False):
        if not self._staged(send, recv):
            return super().all_gather(send, recv, async_op)
        send, recv = _flat(send, "send"), _flat(recv, "recv")
        n = send.numel()
        if recv.numel() != n * self.size:
            raise ValueError(f"all_gather: recv has {recv.numel()} elements, expected {self.size} x {n}")
        self._stats.record("all_gather", recv.numel(), recv.element_size())
        return self._timed("all_gather", lambda: self._s_all_gather(send, recv, "all_gather"), async_op)

    def reduce_scatter(self, send, recv, op: str = "sum", async_op: bool = False, scratch=None):
        if not self._staged(send, recv):
            return super().reduce_scatter(send, recv, op, async_op, scratch)
        send, recv = _flat(send, "send"), _flat(recv, "recv")
        N, n = self.size, recv.numel()
        if send.numel() != n * N:
            raise ValueError(f"reduce_scatter: send has {send.numel()} elements, expected {N} x {n}")
        self._stats.record("reduce_scatter", send.numel(), send.element_size())
        if self.algorithm == "ordered" and op == "sum":
            if scratch is None or scratch.numel() < send.numel() or scratch.dtype != send.dtype \
                    or scratch.device != send.device:
                scratch = torch.empty(send.numel(), dtype=send.dtype, device=send.device)
            tmp = scratch[:send.numel()]

            def body():
                self._s_all_to_all(send, tmp, "reduce_scatter")
                ordered_sum(tmp.view(N, n), recv)  # on torch's current stream
            return self._timed("reduce_scatter", body, async_op)
        check_reducible(send, "reduce_scatter")
        mpi_op = self._op(op)
        m = self.stager.chunk(N + 1, send.dtype)

        def plan(k, s):
            a, b = _span(n, m, k)
            w = b - a
            buf = self.stager.slot(s, send.dtype)
            hs, hr = buf[:N * w], buf[N * m:N * m + w]
            pack = [(hs[q * w:(q + 1) * w], send[q * n + a:q * n + b]) for q in range(N)]
            return pack, lambda: self._mpi_call("reduce_scatter", lambda: self.comm.Reduce_scatter_block(
                buffer_spec(hs, "send"), buffer_spec(hr, "recv"), op=mpi_op)), [(recv[a:b], hr)]

        return self._timed("reduce_scatter", lambda: self.stager.run(_chunks(n, m), plan), async_op)

    def all_reduce(self, t, op: str = "sum", async_op: bool = False, scratch=None):
        if not self._staged(t):
            return super().all_reduce(t, op, async_op, scratch)
        t = _flat(t, "all_reduce")
        N, n = self.size, t.numel()
        self._stats.record("all_reduce", 2 * n, t.element_size())
        if op == "sum" and self.algorithm == "ordered" and n % N == 0 and n >= N:
            c = n // N
            if scratch is None or scratch.numel() < n or scratch.dtype != t.dtype or scratch.device != t.device:
                scratch = torch.empty(n, dtype=t.dtype, device=t.device)
            tmp, mine = scratch[:n], t[self.rank * c:(self.rank + 1) * c]

            def body():
                self._s_all_to_all(t, tmp, "all_reduce")
                ordered_sum(tmp.view(N, c), mine)
                self._s_all_gather(mine, t, "all_reduce")  # in place: own block re-written as is
            return self._timed("all_reduce", body, async_op)
        check_reducible(t, "all_reduce")
        mpi_op = self._op(op)
        m = self.stager.chunk(1, t.dtype)

        def plan(k, s):
            a, b = _span(n, m, k)
            h = self.stager.slot(s, t.dtype)[:b - a]
            return [(h, t[a:b])], lambda: self._mpi_call("all_reduce", lambda: self.comm.Allreduce(
                MPIIN(), buffer_spec(h, "all_reduce"), op=mpi_op)), [(t[a:b], h)]

        return self._timed("all_reduce", lambda: self.stager.run(_chunks(n, m), plan), async_op)

    def gather(self, send, recv, root: int = 0) -> None:
        """recv (N*n, on `root` only; None elsewhere) = concatenation over ranks of send."""
        if not self._staged(send, *([] if recv is None else [recv])):
            return super().gather(send, recv, root)
        send, recv = _flat(send, "send"), _flat(recv, "recv")
        N, n = self.size, send.numel()
        if self.rank == root and recv.numel() != n * N:
            raise ValueError(f"gather: recv has {recv.numel()} elements, expected {N} x {n}")
        self._stats.record("gather", n * N, send.element_size())
        self._timed("gather", lambda: self._s_all_gather(send, recv, "gather", root), False)

    def broadcast(self, t, root: int = 0) -> None:
        if not self._staged(t):
            return super().broadcast(t, root)
        t = _flat(t, "broadcast")
        n = t.numel()
        self._stats.record("broadcast", n, t.element_size())
        m = self.stager.chunk(1, t.dtype)
        me = self.rank == root

        def plan(k, s):
            a, b = _span(n, m, k)
            h = self.stager.slot(s, t.dtype)[:b - a]
            return [(h, t[a:b])] if me else [], lambda: self._mpi_call("broadcast", lambda: self.comm.Bcast(
                buffer_spec(h, "broadcast"), root=root)), [] if me else [(t[a:b], h)]

        self._timed("broadcast", lambda: self.stager.run(_chunks(n, m), plan), False)


def device_mpi(comm: Any = None, reduce_scatter: str = "ordered", device: Any = None,
               aware: bool | None = None) -> MPICommunicator:
    """MPI for CUDA tensors: direct when MPI is CUDA-aware (asked at run time, or
    ZEROMPI_CUDA_AWARE_MPI=0/1), else staged through pinned host slots."""
    if aware is None:
        from ..device import cuda_aware_mpi

        aware = cuda_aware_mpi()
    if aware:
        return MPICommunicator(comm, reduce_scatter=reduce_scatter, device_buffers=True)
    return StagedMPICommunicator(comm, reduce_scatter=reduce_scatter, device=device)


__all__ = ["CUDACopier", "HostCopier", "Stager", "StagedMPICommunicator", "device_mpi"]
