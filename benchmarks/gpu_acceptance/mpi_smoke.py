"""Step 2 of the GPU acceptance run (run.sh here): two ranks, the collectives the engine needs.

    mpiexec -n 2 python -m mpi4py benchmarks/gpu_acceptance/mpi_smoke.py

An ordered all-reduce and a gather of CPU tensors over MPI; where a GPU is visible,
the same on CUDA tensors through the communicator comm.create picks for it (ranks
sharing one GPU: MPI staged through pinned host memory). Rank 0 prints one JSON line.
run.sh puts this checkout first on PYTHONPATH.
"""
import json

import torch

from zerompi.comm import create
from zerompi.runtime import init


def check(comm, dev) -> None:
    N, r = comm.size, comm.rank
    t = torch.arange(4 * N, dtype=torch.float32, device=dev) + r
    comm.all_reduce(t)
    want = N * torch.arange(4 * N, dtype=torch.float32) + sum(range(N))
    assert torch.equal(t.cpu(), want), (t, want)
    recv = torch.empty(3 * N, device=dev) if r == 0 else None
    comm.gather(torch.full((3,), float(r), device=dev), recv, root=0)
    if r == 0:
        assert torch.equal(recv.cpu(), torch.arange(N, dtype=torch.float32).repeat_interleave(3)), recv


world = init()
report = {"ranks": world.Get_size()}
check(create(), torch.device("cpu"))
report["cpu"] = "ok"
if torch.cuda.is_available():
    dev = torch.device("cuda", world.Get_rank() % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    comm = create(device=dev)
    check(comm, dev)
    report["gpu"] = {"comm": type(comm).__name__, "device": str(dev)}
if world.Get_rank() == 0:
    print("mpi_smoke:", json.dumps(report), flush=True)
