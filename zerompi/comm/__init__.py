"""Communicators: the collectives ZeRO needs, behind one protocol (base.Communicator).

What each backend does (which GPU paths have run: docs/status.md):
- mpi (MPICommunicator, mpi.py): CPU tensors, passed to MPI zero-copy from their raw
  addresses; non-blocking collectives (Ialltoall, Iallgather, Iallreduce,
  Ireduce_scatter_block) return a Handle whose wait() takes a deadline. The default
  'ordered' reduce-scatter is an all-to-all plus a sum in rank order (bitwise
  independent of the bucket size); 'native' uses the library's. bf16/fp16 travel as
  16-bit integers and are summed by torch.
- mpi on CUDA tensors (staged.device_mpi): with a CUDA-aware MPI (device.cuda_aware_mpi:
  MPIX_Query_cuda_support, or ZEROMPI_CUDA_AWARE_MPI=0/1) the same MPICommunicator
  takes device addresses after synchronising torch's current stream; otherwise
  StagedMPICommunicator (staged.py) moves them through two constant-size pinned host
  slots, double-buffered, copies on a side stream. Staged calls complete before they
  return. The chunk pipeline is tested on CPU (tests/multirank/test_comm_gpu.py) and ran
  on the GPU; the CUDA-aware path is unverified. Every tensor collective is staged, gather()
  (stage 3's full_state_dict) included.
- nccl (NCCLCommunicator, nccl.py): CUDA tensors over cupy.cuda.nccl, one GPU per rank;
  own stream ordered by events, async handles whose wait(timeout) aborts the NCCL
  communicator at the deadline; 'ordered' reduce-scatter as all-to-all (grouped
  send/recv) + rank-order sum, 'native' NCCL's own (order not fixed). Ran at one rank
  (where NCCL moves nothing); several GPUs are unverified.
- auto: NCCL when the tensors live on a GPU (device="cuda[:k]"), cupy with NCCL is
  importable on every rank and no two ranks share a GPU; MPI on CUDA tensors when ranks
  share a GPU or NCCL is missing; plain MPI for CPU tensors (device None or cpu).

Asking for nccl where it cannot run (no cupy, no GPU, CPU tensors, ranks sharing a GPU)
is a config error naming comm.backend. Counters (stats/reset_stats) count elements and
bytes per collective; communicators are passed explicitly (parallel/dims.py builds
them), never global.
"""
from __future__ import annotations

import socket

import torch

from ..config.errors import ConfigError
from .base import CommStats, CommTimeout, Communicator, DoneHandle, Handle
from .mpi import MPICommunicator


def _config_error(why: str) -> ConfigError:
    return ConfigError("comm.backend", "nccl", f"{why}; use 'mpi' or 'auto'")


def _gpu_key(dev: torch.device) -> str:
    props = torch.cuda.get_device_properties(dev)
    return f"{socket.gethostname()}/{getattr(props, 'uuid', dev.index)}"


def create(world=None, backend: str = "auto", reduce_scatter: str = "ordered", device=None):
    """A communicator over `world` (an mpi4py communicator; COMM_WORLD if None) for
    tensors on `device` (None or cpu: host tensors; cuda[:k]: this rank's GPU).
    Collective over `world` when device is a GPU or backend is nccl."""
    from . import nccl

    if backend not in ("auto", "mpi", "nccl"):
        raise ConfigError("comm.backend", backend, "must be one of auto, mpi, nccl")
    dev = None if device is None else torch.device(device)
    if dev is not None and dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    on_gpu = dev is not None and dev.type == "cuda"
    if backend == "nccl" or (backend == "auto" and on_gpu):
        why = nccl.unavailable(dev)
        if backend == "nccl" and why:
            raise _config_error(why)  # before any MPI call: this rank's own reason
        from .mpi import mpi_module

        base = mpi_module().COMM_WORLD if world is None else world
        if dev is None and why is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        mine = (why, _gpu_key(dev) if why is None else None)
        everyone = base.allgather(mine)  # one decision for the whole group
        whys = [f"rank {r}: {w}" for r, (w, _) in enumerate(everyone) if w]
        keys = [k for _, k in everyone if k]
        if len(set(keys)) < len(keys):
            whys.append("ranks share a GPU, and one NCCL communicator cannot have two ranks "
                        "on the same GPU")
        if not whys:
            return nccl.NCCLCommunicator(base, reduce_scatter=reduce_scatter, device=dev)
        if backend == "nccl":
            raise _config_error("; ".join(whys))
    if on_gpu:
        from .staged import device_mpi

        return device_mpi(world, reduce_scatter=reduce_scatter, device=dev)
    return MPICommunicator(world, reduce_scatter=reduce_scatter)


__all__ = ["CommStats", "CommTimeout", "Communicator", "Handle", "DoneHandle", "MPICommunicator", "create"]
