"""NCCLCommunicator on GPUs (one per rank) against results computed on the CPU from
every rank's inputs: bitwise for data movement and the 'ordered' sums, within rounding
for NCCL's native sums. Also: stream ordering, wait() not blocking the host, the
deadline abort. Rank 0 writes the JSON. Needs cupy with NCCL and N visible GPUs."""
import argparse
import json

import torch
from mpi4py import MPI
from spread import data, ordered_sum as ordered

from zerompi.comm import CommTimeout, create
from zerompi.comm.nccl import NCCL_DTYPES, NCCLCommunicator

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
a = ap.parse_args()
rank, N = MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size
dev = torch.device("cuda", rank)
torch.cuda.set_device(dev)
comm = create(backend="nccl", device=dev)
native = create(backend="nccl", device=dev, reduce_scatter="native")
assert isinstance(comm, NCCLCommunicator)
done = []


def same(x, y, what):
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[y.element_size()]
    assert torch.equal(x.cpu().view(bits), y.view(bits)), what


for case, dt in enumerate((torch.float32, torch.bfloat16, torch.float16), 1):
    n = 1000 * N
    xs = [data(case, r, n, dt) for r in range(N)]
    t = xs[rank].cuda()
    comm.all_reduce(t)
    same(t, ordered(xs), f"all_reduce ordered {dt}")
    recv = torch.empty(n // N, dtype=dt, device=dev)
    comm.reduce_scatter(xs[rank].cuda(), recv)
    same(recv, ordered(xs)[rank * (n // N):(rank + 1) * (n // N)], f"reduce_scatter ordered {dt}")
    t = xs[rank].cuda()
    native.all_reduce(t)  # NCCL's own order: within rounding
    assert torch.allclose(t.cpu().double(), sum(x.double() for x in xs), rtol=1e-2 if dt != torch.float32 else 1e-5,
                          atol=1e-3), dt
    out = torch.empty(N * 7, dtype=dt, device=dev)
    comm.all_gather(xs[rank][:7].cuda(), out)
    same(out, torch.cat([x[:7] for x in xs]), f"all_gather {dt}")
    out = torch.empty(n, dtype=dt, device=dev)
    comm.all_to_all(xs[rank].cuda(), out)
    c = n // N
    same(out, torch.cat([x[rank * c:(rank + 1) * c] for x in xs]), f"all_to_all {dt}")
    t = xs[rank].cuda()
    comm.broadcast(t, root=N - 1)
    same(t, xs[N - 1], f"broadcast {dt}")
assert NCCL_DTYPES[torch.bfloat16] == 9 and NCCL_DTYPES[torch.float32] == 7
done += ["collectives", "bf16"]

# stream ordering: the producer is still running (a 0.3 s sleep) when the collective is issued
x = torch.zeros(4096 * N, device=dev)
torch.cuda._sleep(int(3e8))
x.fill_(rank + 1.0)
h = comm.all_reduce(x, async_op=True)
assert h.keep, "buffers not held by the handle"
h.wait()                       # makes the current stream wait; must not block the host
assert not h._event.query(), "wait() blocked the host until the collective finished"
y = x.clone()
torch.cuda.synchronize()
assert torch.all(y == N * (N + 1) / 2), "collective or consumer not ordered by events"
assert h.test() and h.keep == ()
done.append("stream_order")

# deadline: the collective cannot start before a 2 s sleep; a 0.05 s deadline aborts
victim = create(backend="nccl", device=dev)
x = torch.ones(1024, device=dev)
torch.cuda._sleep(int(2e9))
h = victim.all_reduce(x, async_op=True)
try:
    h.wait(timeout=0.05)
    raise AssertionError("no timeout")
except CommTimeout as e:
    assert "all_reduce" in str(e) and "aborted" in str(e), e
assert victim.aborted
try:
    victim.all_gather(x[:1], torch.empty(N, device=dev))
    raise AssertionError("aborted communicator was used")
except RuntimeError as e:
    assert "aborted" in str(e)
torch.cuda.synchronize()
done.append("deadline_abort")

st = comm.stats()
assert st["all_reduce"]["elements"] >= 2 * 1000 * N
if rank == 0:
    with open(a.out, "w") as f:
        json.dump({"ok": True, "world": N, "checks": done}, f)
