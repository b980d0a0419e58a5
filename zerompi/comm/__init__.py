"""Communicators: the collectives ZeRO needs, behind one protocol (base.Communicator).

What each backend does today:
- mpi (MPICommunicator, mpi.py): CPU tensors, passed to MPI zero-copy from their raw
  addresses; non-blocking collectives (Ialltoall, Iallgather, Iallreduce,
  Ireduce_scatter_block) return a Handle whose wait() takes a deadline. The default
  'ordered' reduce-scatter is an all-to-all plus a sum in rank order (bitwise
  independent of the bucket size); 'native' uses the library's. bf16/fp16 travel as
  16-bit integers and are summed by torch. GPU tensors are refused with a message.
- nccl: not implemented yet (issue 11): asking for it is a config error naming
  comm.backend. CUDA-aware and host-staged MPI for GPU buffers come with it.
- auto: mpi.

Counters (stats/reset_stats) count elements and bytes per collective; communicators
are passed explicitly (parallel/dims.py builds them), never global.
"""
from .base import CommStats, CommTimeout, Communicator, DoneHandle, Handle
from .mpi import MPICommunicator


def create(world=None, backend: str = "auto", reduce_scatter: str = "ordered"):
    """A communicator over `world` (an mpi4py communicator; COMM_WORLD if None)."""
    if backend == "nccl":
        raise ValueError("config key 'comm.backend' = 'nccl': the NCCL backend is not implemented "
                         "yet (issue 11); use 'mpi' or 'auto'")
    return MPICommunicator(world, reduce_scatter=reduce_scatter)


__all__ = ["CommStats", "CommTimeout", "Communicator", "Handle", "DoneHandle", "MPICommunicator", "create"]
