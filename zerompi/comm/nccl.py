"""Communicator over NCCL through `cupy.cuda.nccl`, for CUDA tensors (one GPU per rank).

- Set-up: the group's rank 0 creates the unique id (128 bytes in CuPy 14, a tuple of
  ints in <= 13) and broadcasts it by pickle over the group's MPI communicator, which
  every rank then keeps (an MPICommunicator over a private duplicate) for the small
  object collectives: bcast_object, allgather_object, barrier, allreduce_scalars (host
  floats). One NcclCommunicator per group; split() makes the sub-group's MPI
  communicator, then its own NCCL communicator. cupy is imported only when one is built.
- Streams: collectives run on a dedicated stream of this communicator. Before issuing,
  the comm stream waits on an event recorded on torch's current stream (the producers of
  the buffers); after issuing, a completion event is recorded on the comm stream, and
  Handle.wait() makes the caller's current stream wait on it: wait() never blocks the
  host and never synchronises the device. Blocking calls (async_op=False, broadcast,
  gather) are "complete" in the same sense: ordered before everything the caller's
  stream runs next.
- Lifetimes: every tensor a collective touches gets record_stream(comm stream), so the
  caching allocator does not hand its memory out before the collective is done, and the
  Handle holds references until test()/wait(timeout) has seen the completion event.
- Deadlines: wait(timeout) polls the completion event; past the deadline it aborts the
  NCCL communicator (ncclCommAbort: kernels stuck on a dead peer end, the rank does not
  hang) and raises CommTimeout naming the collective. The communicator is unusable
  afterwards. wait() without a timeout does not block the host, so the watchdog (which
  guards host waits) sees a dead peer only at the next host synchronisation.
- 'ordered' reduce-scatter (the default, as on MPI): an all-to-all (grouped ncclSend /
  ncclRecv) into a scratch buffer, then ((p0 + p1) + p2) + ... on the comm stream: the
  same operations, in the same order, as the CPU path, so results are bitwise independent
  of the bucket size and equal MPICommunicator's for the same inputs (elementwise IEEE
  adds round the same on both). The all-reduce of a sum divisible by N is that plus an
  in-place ncclAllGather. 'native' uses ncclReduceScatter / ncclAllReduce: faster on
  multi-node rings, but NCCL sums in an order of its own (ring/tree, chosen by size and
  topology), so bitwise bucket-size independence does NOT hold there.
- Host tensors: a collective whose tensors are all on the CPU (stage 3's agreement
  rounds, small control messages) goes through the group's MPI communicator instead,
  so one communicator per group serves both kinds and callers never pick a transport.
- dtypes: NCCL's enum values (nccl.h), bf16 = 9 set explicitly (cupyx's map lacks it);
  bool travels as uint8 and 'lor' is a max on it.
Counting follows base.py: all_reduce 2n, reduce_scatter its input, all_gather its output.
A group of one still goes through NCCL (cheap, and the path a one-GPU test exercises).
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from .base import CommStats, CommTimeout, Handle
from .mpi import MPICommunicator, ordered_sum

# ncclDataType_t / ncclRedOp_t values (nccl.h; FLOAT16=6 FLOAT32=7 FLOAT64=8 BFLOAT16=9)
NCCL_DTYPES = {torch.int8: 0, torch.uint8: 1, torch.bool: 1, torch.int32: 2, torch.int64: 4,
               torch.float16: 6, torch.float32: 7, torch.float64: 8, torch.bfloat16: 9}
NCCL_OPS = {"sum": 0, "max": 2, "min": 3}


def _nccl():
    from cupy.cuda import nccl  # lazy: importing this module never needs cupy

    return nccl


def unavailable(device: "torch.device | str | None" = None) -> str | None:
    """Why NCCL cannot serve this rank (None when it can)."""
    if device is not None and torch.device(device).type != "cuda":
        return f"NCCL needs CUDA tensors, but the device is {torch.device(device)}"
    try:
        nccl = _nccl()
    except ImportError as e:
        return f"cupy is not installed ({e}; pip install -e .[cuda12] or .[cuda13], see README)"
    except Exception as e:  # noqa: BLE001  a cupy that does not fit this CUDA fails otherwise
        return f"cupy cannot be imported ({type(e).__name__}: {e})"
    if not getattr(nccl, "available", True):
        # CuPy >= 13 loads libnccl at import of cupy.cuda.nccl and sets available=False
        # when that fails
        return "cupy cannot load NCCL (install nvidia-nccl-cu12 / -cu13, the one of cupy's CUDA)"
    if not torch.cuda.is_available():
        return "no CUDA device is visible (torch.cuda.is_available() is False)"
    return None


def _on_host(*ts) -> bool:
    """True when every tensor is a CPU tensor (or numpy array): MPI carries it."""
    return all(not isinstance(t, torch.Tensor) or t.device.type == "cpu" for t in ts)


class _NcclHandle(Handle):
    """Completion of one collective on the comm stream (see the module docstring)."""

    def __init__(self, owner: "NCCLCommunicator", op: str, event, keep: tuple):
        self._owner, self._event, self.keep = owner, event, keep
        super().__init__(owner._stats, op, wait_fn=lambda: None, test_fn=self._poll,
                         finish=lambda: torch.cuda.current_stream(owner.device).wait_event(event))

    def _poll(self) -> bool:
        if self._event.query():
            self.keep = ()  # the collective is done with the buffers
            return True
        return False

    def test(self) -> bool:
        # after wait() (done: torch's stream is ordered after the collective) the
        # collective may still be running; keep polling so the buffers are let go
        if self.done and self.keep:
            self._poll()
        return super().test()

    def wait(self, timeout: float | None = None) -> None:
        try:
            super().wait(timeout)
        except CommTimeout as e:
            self._owner.abort()
            raise CommTimeout(f"{e}; NCCL communicator aborted") from None


class NCCLCommunicator:
    """Collectives over one NCCL communicator per group (module docstring)."""

    backend = "nccl"

    def __init__(self, comm: Any = None, reduce_scatter: str = "ordered",
                 device: "torch.device | str | None" = None, _dup: bool = True,
                 _mpi: MPICommunicator | None = None):
        why = unavailable(device)
        if why:
            raise RuntimeError(why)
        nccl = _nccl()
        self._stats = CommStats() if _mpi is None else _mpi._stats
        # host tensors and objects go through this MPI twin, counted in the same table
        self.mpi = _mpi if _mpi is not None else MPICommunicator(comm, reduce_scatter, _dup=_dup,
                                                                  stats=self._stats)
        self.rank, self.size, self.algorithm = self.mpi.rank, self.mpi.size, self.mpi.algorithm
        self.device = torch.device("cuda", torch.cuda.current_device()) if device is None \
            else torch.device(device)
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        uid = nccl.get_unique_id() if self.rank == 0 else None
        uid = self.mpi.bcast_object(uid, root=0)  # bytes (CuPy 14) or tuple (<= 13): pickled as is
        with torch.cuda.device(self.device):
            self._comm = nccl.NcclCommunicator(self.size, uid, self.rank)
            self.stream = torch.cuda.Stream(self.device)
        self.aborted = False

    # ------------------------------------------------------------ helpers
    def _check(self, t: torch.Tensor, name: str) -> int:
        if not isinstance(t, torch.Tensor) or t.device.type != "cuda":
            raise ValueError(f"{name}: NCCL communicator needs CUDA tensors, got "
                             f"{getattr(t, 'device', type(t).__name__)}")
        if not t.is_contiguous():
            raise ValueError(f"{name}: tensor must be contiguous")
        try:
            return NCCL_DTYPES[t.dtype]
        except KeyError:
            raise TypeError(f"{name}: no NCCL datatype for {t.dtype}") from None

    def _op(self, op: str, t: torch.Tensor) -> int:
        if op == "lor":
            if t.dtype not in (torch.bool, torch.uint8):
                raise TypeError(f"reduction op 'lor' on {t.dtype}: NCCL has no logical or; use bool")
            return NCCL_OPS["max"]
        try:
            return NCCL_OPS[op]
        except KeyError:
            raise ValueError(f"reduction op {op!r}: one of sum, max, min, lor") from None

    def abort(self) -> None:
        """End this communicator's NCCL work at once (after a deadline); not reusable."""
        if not self.aborted:
            self.aborted = True
            self._comm.abort()

    def _launch(self, op: str, tensors: tuple, body: Callable[[int], None], async_op: bool):
        """Issue body(stream_ptr) on the comm stream, ordered after torch's current stream."""
        if self.aborted:
            raise RuntimeError(f"{op}: this NCCL communicator was aborted after a timeout")
        with torch.cuda.device(self.device):
            self.stream.wait_stream(torch.cuda.current_stream(self.device))  # event, both sides
            with torch.cuda.stream(self.stream):  # torch work inside body (sums) runs here too
                body(self.stream.cuda_stream)
            for t in tensors:
                t.record_stream(self.stream)
            done = torch.cuda.Event()
            done.record(self.stream)
        h = _NcclHandle(self, op, done, tensors)
        if async_op:
            return h
        h.wait()
        return None

    def _a2a(self, send: torch.Tensor, recv: torch.Tensor, dt: int, s: int) -> None:
        """recv block q = send block `rank` of rank q (grouped point-to-point)."""
        nccl, N = _nccl(), self.size
        n, isz = send.numel() // N, send.element_size()
        recv[self.rank * n:(self.rank + 1) * n].copy_(send[self.rank * n:(self.rank + 1) * n])
        nccl.groupStart()
        try:
            for q in range(N):
                if q != self.rank:
                    self._comm.send(send.data_ptr() + q * n * isz, n, dt, q, s)
                    self._comm.recv(recv.data_ptr() + q * n * isz, n, dt, q, s)
        finally:
            nccl.groupEnd()

    def _scratch(self, scratch, like: torch.Tensor, n: int) -> torch.Tensor:
        if scratch is None or scratch.numel() < n or scratch.dtype != like.dtype or scratch.device != like.device:
            with torch.cuda.stream(self.stream):  # owned by the comm stream: freed safely
                scratch = torch.empty(n, dtype=like.dtype, device=like.device)
        return scratch[:n]

    # ------------------------------------------------------------ collectives
    def all_reduce(self, t, op: str = "sum", async_op: bool = False, scratch=None):
        if _on_host(t):
            return self.mpi.all_reduce(t, op, async_op, scratch)
        dt, n = self._check(t, "all_reduce"), t.numel()
        self._stats.record("all_reduce", 2 * n, t.element_size())
        rop = self._op(op, t)
        if op == "sum" and self.algorithm == "ordered" and n % self.size == 0 and n >= self.size:
            c = n // self.size
            tmp = self._scratch(scratch, t, n)
            mine = t[self.rank * c:(self.rank + 1) * c]

            def body(s):
                self._a2a(t, tmp, dt, s)
                ordered_sum(tmp.view(self.size, c), mine)
                self._comm.allGather(mine.data_ptr(), t.data_ptr(), c, dt, s)  # in place
            return self._launch("all_reduce", (t, tmp), body, async_op)
        return self._launch("all_reduce", (t,), lambda s: self._comm.allReduce(
            t.data_ptr(), t.data_ptr(), n, dt, rop, s), async_op)

    def reduce_scatter(self, send, recv, op: str = "sum", async_op: bool = False, scratch=None):
        if _on_host(send, recv):
            return self.mpi.reduce_scatter(send, recv, op, async_op, scratch)
        dt, n = self._check(send, "send"), recv.numel()
        self._check(recv, "recv")
        if send.numel() != n * self.size:
            raise ValueError(f"reduce_scatter: send has {send.numel()} elements, expected {self.size} x {n}")
        self._stats.record("reduce_scatter", send.numel(), send.element_size())
        rop = self._op(op, send)
        if self.algorithm == "ordered" and op == "sum":
            tmp = self._scratch(scratch, send, send.numel())

            def body(s):
                self._a2a(send, tmp, dt, s)
                ordered_sum(tmp.view(self.size, n), recv)
            return self._launch("reduce_scatter", (send, recv, tmp), body, async_op)
        return self._launch("reduce_scatter", (send, recv), lambda s: self._comm.reduceScatter(
            send.data_ptr(), recv.data_ptr(), n, dt, rop, s), async_op)

    def all_gather(self, send, recv, async_op: bool = False):
        if _on_host(send, recv):
            return self.mpi.all_gather(send, recv, async_op)
        dt, n = self._check(send, "send"), send.numel()
        self._check(recv, "recv")
        if recv.numel() != n * self.size:
            raise ValueError(f"all_gather: recv has {recv.numel()} elements, expected {self.size} x {n}")
        self._stats.record("all_gather", recv.numel(), recv.element_size())
        return self._launch("all_gather", (send, recv), lambda s: self._comm.allGather(
            send.data_ptr(), recv.data_ptr(), n, dt, s), async_op)  # send may be recv's own block

    def all_to_all(self, send, recv, async_op: bool = False):
        if _on_host(send, recv):
            return self.mpi.all_to_all(send, recv, async_op)
        dt = self._check(send, "send")
        self._check(recv, "recv")
        if send.numel() != recv.numel() or send.numel() % self.size:
            raise ValueError(f"all_to_all: send has {send.numel()} and recv {recv.numel()} elements; "
                             f"both must be the same multiple of {self.size}")
        self._stats.record("all_to_all", send.numel(), send.element_size())
        return self._launch("all_to_all", (send, recv), lambda s: self._a2a(send, recv, dt, s), async_op)

    def broadcast(self, t, root: int = 0) -> None:
        if _on_host(t):
            return self.mpi.broadcast(t, root)
        dt, n = self._check(t, "broadcast"), t.numel()
        self._stats.record("broadcast", n, t.element_size())
        self._launch("broadcast", (t,), lambda s: self._comm.bcast(t.data_ptr(), n, dt, root, s), False)

    def gather(self, send, recv, root: int = 0) -> None:
        """recv (N*n, on `root` only) = concatenation over ranks of send (point-to-point)."""
        if _on_host(send, *([recv] if recv is not None else [])):
            return self.mpi.gather(send, recv, root)
        dt, n = self._check(send, "send"), send.numel()
        self._stats.record("gather", n * self.size, send.element_size())
        keep = (send, recv) if self.rank == root else (send,)

        def body(s):
            nccl, isz = _nccl(), send.element_size()
            if self.rank == root:
                self._check(recv, "recv")
                recv[root * n:(root + 1) * n].copy_(send)
            nccl.groupStart()
            try:
                if self.rank != root:
                    self._comm.send(send.data_ptr(), n, dt, root, s)
                else:
                    for q in range(self.size):
                        if q != root:
                            self._comm.recv(recv.data_ptr() + q * n * isz, n, dt, q, s)
            finally:
                nccl.groupEnd()
        self._launch("gather", keep, body, False)

    # ------------------------------------------------------------ host-side, through MPI
    def allreduce_scalars(self, values: list[float], op: str = "sum") -> list[float]:
        return self.mpi.allreduce_scalars(values, op)

    def start_allreduce_scalars(self, values: list[float], op: str = "sum"):
        return self.mpi.start_allreduce_scalars(values, op)

    def barrier(self, poll: bool = False) -> None:
        self.mpi.barrier(poll)

    def bcast_object(self, obj: Any, root: int = 0) -> Any:
        return self.mpi.bcast_object(obj, root)

    def allgather_object(self, obj: Any) -> list:
        return self.mpi.allgather_object(obj)

    carries_gpu_tensors = True

    def set_idle(self, fn) -> None:
        self.mpi.set_idle(fn)  # only host-side waits poll; NCCL work is on the stream

    def split(self, color: int, key: int | None = None, counted_with=None) -> "NCCLCommunicator":
        # collective over this group, like the NCCL init after it; the twin carries the table
        sub = self.mpi.split(color, key, counted_with=counted_with)
        return NCCLCommunicator(reduce_scatter=self.algorithm, device=self.device, _mpi=sub)

    def duplicate(self) -> "NCCLCommunicator":
        return self.split(0, self.rank, counted_with=self)

    def stats(self) -> dict:
        return self._stats.as_dict()

    def reset_stats(self) -> None:
        self._stats.reset()


__all__ = ["NCCLCommunicator", "NCCL_DTYPES", "NCCL_OPS", "unavailable"]
