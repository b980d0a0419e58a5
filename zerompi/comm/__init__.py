"""Communicators: the collectives ZeRO needs, behind one interface.

Every communicator has rank, size, all_reduce, reduce_scatter, all_gather, broadcast
(non-blocking variants return a Handle with test()/wait()), split, and per-collective
counters (stats/reset_stats). Communicators are passed explicitly, never global.
"""
from .base import CommStats, DoneHandle, Handle
from .mpi import MPICommunicator


def create(world=None, backend: str = "auto", reduce_scatter: str = "ordered", device=None):
    """A communicator over `world` (an mpi4py communicator; COMM_WORLD if None).

    backend 'auto' is MPI (CPU tensors); an NCCL backend for GPU tensors is issue 4."""
    if backend == "nccl":
        raise ValueError("config key 'comm.backend' = 'nccl': the NCCL backend is not implemented "
                         "yet (issue 4); use 'mpi' or 'auto'")
    return MPICommunicator(world, reduce_scatter=reduce_scatter)


__all__ = ["CommStats", "Handle", "DoneHandle", "MPICommunicator", "create"]
