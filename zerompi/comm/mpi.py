"""Communicator over mpi4py's buffer (uppercase) calls: no pickling in the hot path.

Tensors are CPU torch tensors (or numpy arrays), passed to MPI zero-copy; with
device_buffers=True (a CUDA-aware MPI, see device.cuda_aware_mpi) CUDA tensors too, after
synchronising torch's current stream. Without a CUDA-aware MPI, staged.py moves CUDA
tensors through pinned host buffers. bf16/fp16 have no MPI reduction type: they are
moved as 16-bit integers and summed by torch, which the 'ordered' reduce-scatter does
anyway.

reduce_scatter 'ordered' (the default) is an alltoall followed by a sum in rank order
0..N-1 on the receiver: the pairwise-exchange algorithm, same bytes on the wire as any
reduce-scatter, but every element is summed in the same order whatever the message size.
MPICH picks its reduce-scatter/allreduce algorithm by message size, and at N >= 3 the
algorithms sum in different orders (many elements differ in the last bit),
so results would otherwise depend on the bucket size.
"""
from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from ..runtime.agree import ObjectCollectives
from ..runtime.watchdog import waiting
from .base import CommStats, DoneHandle, Handle, Scalars

_OPS = ("sum", "max", "min", "lor")


_MPI = None


def mpi_module():
    """mpi4py.MPI; the first import starts MPI under the start-up deadline (runtime/startup.py).
    Kept once found: every buffer of every collective asks for it."""
    global _MPI
    if _MPI is None:
        from ..runtime import mpi

        _MPI = mpi()
    return _MPI


_MPI_TYPES = None


def _mpi_type(dtype: torch.dtype):
    global _MPI_TYPES
    if _MPI_TYPES is None:
        MPI = mpi_module()
        _MPI_TYPES = {torch.float32: MPI.FLOAT, torch.float64: MPI.DOUBLE,
                      # 16-bit floats only travel (never reduced by MPI): move them as int16
                      torch.bfloat16: MPI.INT16_T, torch.float16: MPI.INT16_T,
                      torch.int16: MPI.INT16_T, torch.int32: MPI.INT32_T, torch.int64: MPI.INT64_T,
                      torch.uint8: MPI.UINT8_T, torch.int8: MPI.INT8_T, torch.bool: MPI.C_BOOL}
    try:
        return _MPI_TYPES[dtype]
    except KeyError:
        raise TypeError(f"no MPI datatype for {dtype}") from None


def buffer_spec(t: Any, name: str, device_ok: bool = False):
    """Zero-copy MPI buffer spec of a contiguous CPU tensor (or a numpy array).

    Built from the raw address rather than tensor.numpy(): numpy export marks a torch
    storage non-resizable for good, and stage 3 frees gathered parameters by resizing
    their storage. The caller keeps the tensor alive until the operation completes.

    device_ok (CUDA-aware MPI only): a CUDA tensor's device address is passed as is.
    MPI knows nothing of CUDA streams, so torch's current stream on that device is
    synchronised first: kernels that produce (or still read) the buffer are done."""
    if isinstance(t, np.ndarray):
        return t
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor or numpy array, got {type(t).__name__}")
    if t.device.type != "cpu":
        if not (device_ok and t.device.type == "cuda"):
            raise ValueError(f"{name}: MPI communicator needs CPU tensors, got {t.device} "
                             "(GPU tensors go through comm.backend=nccl or a CUDA-aware MPI)")
        torch.cuda.current_stream(t.device).synchronize()
    if not t.is_contiguous():
        raise ValueError(f"{name}: tensor must be contiguous")
    buf = mpi_module().buffer.fromaddress(t.data_ptr(), t.numel() * t.element_size())
    return [buf, _mpi_type(t.dtype)]


def check_reducible(t: Any, name: str) -> None:
    dt = t.dtype
    if isinstance(t, torch.Tensor) and dt in (torch.bfloat16, torch.float16):
        raise TypeError(f"{name}: MPI cannot reduce {dt}; reduce in fp32 or use the ordered algorithm")


def ordered_sum(parts: torch.Tensor, out: torch.Tensor) -> None:
    """out = ((p0 + p1) + p2) + ... over parts' first dimension: fixed order on every rank,
    for every message size (in out's dtype when it matches, else accumulated in parts')."""
    if out.dtype == parts.dtype:
        out.copy_(parts[0])
        for q in range(1, parts.shape[0]):
            out.add_(parts[q])
    else:
        acc = parts[0].clone()
        for q in range(1, parts.shape[0]):
            acc.add_(parts[q])
        out.copy_(acc)


class MPICommunicator(ObjectCollectives):
    """Collectives over an (internally duplicated) MPI communicator; bcast_object and
    allgather_object (pickled, set-up only) from runtime/agree.py."""

    backend = "mpi"

    def __init__(self, comm: Any = None, reduce_scatter: str = "ordered", _dup: bool = True,
                 device_buffers: bool = False, stats: CommStats | None = None):
        MPI = mpi_module()
        comm = MPI.COMM_WORLD if comm is None else comm
        # A private duplicate keeps our traffic apart from the user's own messages.
        with waiting("comm_dup"):
            self.comm = comm.Dup() if _dup else comm
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        # Called while a wait on this communicator polls (set_idle): stage 3 answers its
        # agreement rounds here (the engine sets it on the tp group), because a dp peer may
        # need this rank in a round before it can reach the tp collective this rank waits for.
        self.idle = None
        if reduce_scatter not in ("ordered", "native"):
            raise ValueError(f"reduce_scatter algorithm {reduce_scatter!r}: ordered or native")
        self.algorithm = reduce_scatter
        # CUDA-aware MPI (device.cuda_aware_mpi()): CUDA tensors go to MPI directly
        self.device_buffers = device_buffers
        self._stats = CommStats() if stats is None else stats

    @property
    def carries_gpu_tensors(self) -> bool:
        return self.device_buffers

    def set_idle(self, fn) -> None:
        self.idle = fn

    # ------------------------------------------------------------ helpers
    def _op(self, op: str):
        MPI = mpi_module()
        try:
            return {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN, "lor": MPI.LOR}[op]
        except KeyError:
            raise ValueError(f"reduction op {op!r}: one of {_OPS}") from None

    def _buf(self, t: Any, name: str):
        return buffer_spec(t, name, self.device_buffers)

    def _run(self, opname: str, req, async_op: bool, finish=None, keep=()):
        h = Handle(self._stats, opname, req.Wait, req.Test, finish, idle=self.idle)
        h.keep = keep  # buffers MPI writes into must outlive the request
        if async_op:
            return h
        h.wait()
        return None

    # ------------------------------------------------------------ collectives
    def all_reduce(self, t, op: str = "sum", async_op: bool = False, scratch: torch.Tensor | None = None):
        """In-place all-reduce. Sums of buffers divisible by the group size use the
        ordered reduce-scatter + all-gather (deterministic, identical on all ranks);
        `scratch` (>= t's size, same dtype) avoids allocating its receive space."""
        n = t.numel() if isinstance(t, torch.Tensor) else t.size
        self._stats.record("all_reduce", 2 * n, t.element_size() if isinstance(t, torch.Tensor) else t.itemsize)
        if self.size == 1:
            return DoneHandle() if async_op else None
        if op == "sum" and self.algorithm == "ordered" and isinstance(t, torch.Tensor) \
                and n % self.size == 0 and n >= self.size:
            c = n // self.size
            mine = t[self.rank * c:(self.rank + 1) * c]
            if scratch is None or scratch.numel() < n or scratch.dtype != t.dtype \
                    or scratch.device != t.device:
                scratch = torch.empty(n, dtype=t.dtype, device=t.device)
            scratch = scratch[:n]
            req = self.comm.Ialltoall(self._buf(t, "all_reduce"), self._buf(scratch, "scratch"))

            def finish():
                ordered_sum(scratch.view(self.size, c), mine)
                self.comm.Allgather(MPIIN(), self._buf(t, "all_reduce"))

            return self._run("all_reduce", req, async_op, finish, keep=(t, scratch))
        check_reducible(t, "all_reduce")
        req = self.comm.Iallreduce(MPIIN(), self._buf(t, "all_reduce"), op=self._op(op))
        return self._run("all_reduce", req, async_op, keep=(t,))


    def reduce_scatter(self, send, recv, op: str = "sum", async_op: bool = False,
                       scratch: torch.Tensor | None = None):
        """recv (n) = this rank's n-element block of the sum over ranks of send (N*n)."""
        n = recv.numel()
        if send.numel() != n * self.size:
            raise ValueError(f"reduce_scatter: send has {send.numel()} elements, expected "
                             f"{self.size} x {n}")
        self._stats.record("reduce_scatter", send.numel(), send.element_size())
        if self.size == 1:
            recv.copy_(send)
            return DoneHandle() if async_op else None
        if self.algorithm == "ordered" and op == "sum":
            if scratch is None or scratch.numel() < send.numel() or scratch.dtype != send.dtype \
                    or scratch.device != send.device:
                scratch = torch.empty(send.numel(), dtype=send.dtype, device=send.device)
            tmp = scratch[:send.numel()]
            req = self.comm.Ialltoall(self._buf(send, "send"), self._buf(tmp, "scratch"))
            return self._run("reduce_scatter", req, async_op,
                             lambda: ordered_sum(tmp.view(self.size, n), recv),
                             keep=(send, tmp, recv))
        check_reducible(send, "reduce_scatter")
        req = self.comm.Ireduce_scatter_block(self._buf(send, "send"), self._buf(recv, "recv"), op=self._op(op))
        return self._run("reduce_scatter", req, async_op, keep=(send, recv))

    def all_gather(self, send, recv, async_op: bool = False):
        """recv (N*n) = concatenation over ranks of send (n). `send` may be this rank's
        own block of `recv` (in place)."""
        n = send.numel()
        if recv.numel() != n * self.size:
            raise ValueError(f"all_gather: recv has {recv.numel()} elements, expected {self.size} x {n}")
        self._stats.record("all_gather", recv.numel(), recv.element_size())
        inplace = (isinstance(send, torch.Tensor) and send.data_ptr()
                   == recv.data_ptr() + self.rank * n * recv.element_size())
        if self.size == 1:
            if not inplace:
                recv.copy_(send)
            return DoneHandle() if async_op else None
        sbuf = MPIIN() if inplace else self._buf(send, "send")
        req = self.comm.Iallgather(sbuf, self._buf(recv, "recv"))
        return self._run("all_gather", req, async_op, keep=(send, recv))

    def all_to_all(self, send, recv, async_op: bool = False):
        """recv block q (n elements) = send block `rank` of rank q; send and recv hold N*n."""
        if send.numel() != recv.numel() or send.numel() % self.size:
            raise ValueError(f"all_to_all: send has {send.numel()} and recv {recv.numel()} elements; "
                             f"both must be the same multiple of {self.size}")
        self._stats.record("all_to_all", send.numel(), send.element_size())
        if self.size == 1:
            recv.copy_(send)
            return DoneHandle() if async_op else None
        req = self.comm.Ialltoall(self._buf(send, "send"), self._buf(recv, "recv"))
        return self._run("all_to_all", req, async_op, keep=(send, recv))

    def gather(self, send, recv, root: int = 0) -> None:
        """recv (N*n, on `root` only; None elsewhere) = concatenation over ranks of send."""
        n = send.numel()
        self._stats.record("gather", n * self.size, send.element_size())
        if self.size == 1:
            recv.copy_(send)
            return
        t0 = time.perf_counter()
        with waiting("gather"):
            self.comm.Gather(self._buf(send, "send"), self._buf(recv, "recv") if self.rank == root else None, root=root)
        self._stats.add_time("gather", time.perf_counter() - t0)

    def broadcast(self, t, root: int = 0) -> None:
        n = t.numel()
        self._stats.record("broadcast", n, t.element_size())
        if self.size == 1:
            return
        t0 = time.perf_counter()
        with waiting("broadcast"):
            self.comm.Bcast(self._buf(t, "broadcast"), root=root)
        self._stats.add_time("broadcast", time.perf_counter() - t0)

    def allreduce_scalars(self, values: list[float], op: str = "sum") -> list[float]:
        """Small float64 all-reduce (norms, overflow flags); counted like any all-reduce."""
        buf = torch.tensor(values, dtype=torch.float64)
        self.all_reduce(buf, op=op) if op != "sum" else self._small_sum(buf)
        return buf.tolist()

    def start_allreduce_scalars(self, values: list[float], op: str = "sum") -> Scalars:
        buf = torch.tensor(values, dtype=torch.float64)
        return Scalars(self.all_reduce(buf, op=op, async_op=True), buf)

    def _small_sum(self, buf: torch.Tensor) -> None:
        # Native Allreduce on a handful of scalars: its order is fixed for a fixed size.
        self._stats.record("all_reduce", 2 * buf.numel(), buf.element_size())
        if self.size > 1:
            t0 = time.perf_counter()
            with waiting("all_reduce"):
                self.comm.Allreduce(MPIIN(), self._buf(buf, "scalars"), op=mpi_module().SUM)
            self._stats.add_time("all_reduce", time.perf_counter() - t0)

    def barrier(self, poll: bool = False) -> None:
        """poll=True: MPI_Ibarrier tested between growing sleeps (at most 1 ms) instead
        of MPI_Barrier, in which MPICH spins: a rank that arrives early then leaves its
        core to the ranks still working (4 ranks on 2 cores after an uneven checkpoint
        read, say). For waits of unequal work, not for the step's synchronisation."""
        with waiting("barrier"):
            if not poll or self.size == 1:
                self.comm.Barrier()
                return
            req, pause = self.comm.Ibarrier(), 1e-5
            while not req.Test():
                time.sleep(pause)
                pause = min(2 * pause, 1e-3)

    def split(self, color: int, key: int | None = None, counted_with=None) -> "MPICommunicator":
        with waiting("split"):
            sub = self.comm.Split(color, self.rank if key is None else key)
        c = self._from_split(sub)
        if counted_with is not None:
            c._stats = counted_with._stats  # a communicator of this package: same table
        return c

    def duplicate(self) -> "MPICommunicator":
        return self.split(0, self.rank, counted_with=self)

    def _from_split(self, sub) -> "MPICommunicator":
        return MPICommunicator(sub, reduce_scatter=self.algorithm, _dup=False,
                               device_buffers=self.device_buffers)

    # ------------------------------------------------------------ stats
    def stats(self) -> dict:
        return self._stats.as_dict()

    def reset_stats(self) -> None:
        self._stats.reset()


def MPIIN():
    return mpi_module().IN_PLACE
