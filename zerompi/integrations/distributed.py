"""A torch.distributed process group from the MPI world, with nothing for the user to set.

    import zerompi, torch.distributed as dist
    zerompi.init_process_group()          # collective over MPI_COMM_WORLD
    dist.all_reduce(metric)               # DistributedSampler, dist.get_rank() ... work too

Under mpiexec/srun no MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE exist: the ranks agree over
MPI instead. Rank 0 opens torch's TCPStore on a port the system picks (no two jobs
collide), and broadcasts its address and that port; every rank then joins with its
MPI rank and size. The address: 127.0.0.1 when every rank is on rank 0's node, else
MASTER_ADDR when set, else the address rank 0's host name resolves to (`address=`
overrides all three). Backend "auto": NCCL when this rank has a GPU (it binds the rank
to cuda:(node-local rank mod GPUs) first, as zerompi.device.bind does), gloo otherwise.

The group is the user's: the engine keeps its own MPI/NCCL communicators, so collectives
in user code never interleave with the engine's. Its ranks are COMM_WORLD's; with tensor
parallelism, shard data by `engine.dims.dp_rank`/`dp_size`, not dist.get_rank().
"""
from __future__ import annotations

import datetime
import os
import socket


def init_process_group(backend: str = "auto", *, address: str | None = None, timeout_s: float = 600.0):
    """Initialise torch.distributed's default group over COMM_WORLD; collective. Returns
    the backend. Called again (or torch.distributed already initialised by someone else
    with the same world): returns at once."""
    import torch
    import torch.distributed as dist

    from .. import runtime
    from ..runtime import watchdog

    if backend not in ("auto", "gloo", "nccl", "mpi"):
        raise ValueError(f"init_process_group: backend must be auto, gloo, nccl or mpi, got {backend!r}")
    if not dist.is_available():
        raise RuntimeError("init_process_group: this torch build has no torch.distributed")
    world = runtime.init()
    rank, size = world.Get_rank(), world.Get_size()
    if dist.is_initialized():
        if dist.get_world_size() != size or dist.get_rank() != rank:
            raise RuntimeError(f"torch.distributed is already initialised as rank {dist.get_rank()} of "
                               f"{dist.get_world_size()}, but this is MPI rank {rank} of {size}")
        return dist.get_backend()
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() > 0 else "gloo"
    if backend == "nccl":
        from ..device import bind

        bind(world)
    with watchdog.waiting("init_process_group (address agreement)"):
        hosts = world.allgather(socket.gethostname())
    host = address or ("127.0.0.1" if len(set(hosts)) == 1 else os.environ.get("MASTER_ADDR")
                       or socket.gethostbyname(hosts[0]))
    timeout = datetime.timedelta(seconds=timeout_s)
    store, port = None, None
    if rank == 0:
        store = dist.TCPStore("0.0.0.0" if host != "127.0.0.1" else host, 0, size, is_master=True,
                              timeout=timeout, wait_for_workers=False)
        port = store.port
    with watchdog.waiting("init_process_group (address agreement)"):
        port = world.bcast(port, root=0)
    if rank != 0:
        store = dist.TCPStore(host, port, size, is_master=False, timeout=timeout)
    kw = {"device_id": torch.device("cuda", torch.cuda.current_device())} if backend == "nccl" else {}
    with watchdog.waiting("init_process_group"):
        dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout, **kw)
    return backend

