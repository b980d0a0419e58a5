"""Host-staged MPI collectives (zerompi/comm/staged.py) against the unstaged
MPICommunicator on the same inputs.

--device cpu: CPU tensors stand in for device memory (HostCopier, stage_cpu=True), so
the chunking and the double-buffered pipeline run here without a GPU. --device cuda:
the same body on CUDA tensors with the CUDA copier (pinned slots, side stream); ranks
may share one GPU. Slots are made tiny so every size below spans several chunks, with
sizes not divisible by the chunk. Rank 0 writes the JSON.
"""
import argparse
import json

import torch
from mpi4py import MPI
from spread import data

from zerompi.comm import MPICommunicator, create
from zerompi.comm.staged import SLOT_BYTES, StagedMPICommunicator, device_mpi

torch.set_num_threads(1)
ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("--device", default="cpu")
a = ap.parse_args()

rank, N = MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size
dev = torch.device(a.device)
if dev.type == "cuda":
    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
ref = MPICommunicator()
ref_native = MPICommunicator(reduce_scatter="native")
done: list[str] = []
details: dict = {"world": N, "device": str(dev)}


def staged(slot_bytes, algorithm="ordered"):
    return StagedMPICommunicator(reduce_scatter=algorithm, device=dev, slot_bytes=slot_bytes,
                                 stage_cpu=dev.type == "cpu")


def bits(x):
    return x.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()])


def same(x, y, what):
    x = x.cpu()
    assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(bits(x), bits(y)), what


def d(x):
    return x.to(dev)


case = 0
SLOTS = [48, 200, SLOT_BYTES]          # 48 bytes: a handful of elements per chunk
SIZES = [1, 7, 13, 50]                 # per-rank block sizes, not multiples of the chunk
for slot in SLOTS:
    sc, sn = staged(slot), staged(slot, "native")
    for n in SIZES:
        for dt in (torch.float32, torch.bfloat16):
            case += 1
            x = data(case, rank, N * n, dt)
            what = f"slot {slot} n {n} {dt}"
            # all_gather, separate and in place
            want = torch.empty(N * n, dtype=dt)
            ref.all_gather(x[:n], want)
            got = d(torch.empty(N * n, dtype=dt))
            sc.all_gather(d(x[:n]), got)
            same(got, want, f"all_gather {what}")
            got = d(torch.zeros(N * n, dtype=dt))
            got[rank * n:(rank + 1) * n] = d(x[:n])
            sc.all_gather(got[rank * n:(rank + 1) * n], got)
            same(got, want, f"all_gather in place {what}")
            # all_to_all
            want = torch.empty(N * n, dtype=dt)
            ref.all_to_all(x, want)
            got = d(torch.empty(N * n, dtype=dt))
            sc.all_to_all(d(x), got)
            same(got, want, f"all_to_all {what}")
            # ordered reduce-scatter: bitwise the unstaged one (all-to-all + rank-order sum)
            want = torch.empty(n, dtype=dt)
            ref.reduce_scatter(x, want)
            got = d(torch.empty(n, dtype=dt))
            h = sc.reduce_scatter(d(x), got, async_op=True)
            assert h.test() and h.done is True
            h.wait()
            same(got, want, f"reduce_scatter ordered {what}")
            # ordered all-reduce (N*n divisible by N): bitwise
            want = x.clone()
            ref.all_reduce(want)
            got = d(x.clone())
            sc.all_reduce(got)
            same(got, want, f"all_reduce ordered {what}")
            # gather to the last rank: recv exists there only
            last = rank == N - 1
            want = torch.empty(N * n, dtype=dt) if last else None
            ref.gather(x[:n], want, root=N - 1)
            got = d(torch.empty(N * n, dtype=dt)) if last else None
            sc.gather(d(x[:n]), got, root=N - 1)
            if last:
                same(got, want, f"gather {what}")
            # broadcast from the last rank
            want = x.clone()
            ref.broadcast(want, root=N - 1)
            got = d(x.clone())
            sc.broadcast(got, root=N - 1)
            same(got, want, f"broadcast {what}")
            if dt == torch.float32:
                # native sums: chunks are smaller messages, MPI may sum in another order
                want = torch.empty(n, dtype=dt)
                ref_native.reduce_scatter(x, want)
                got = d(torch.empty(n, dtype=dt))
                sn.reduce_scatter(d(x), got)
                assert torch.allclose(got.cpu(), want, rtol=1e-5, atol=1e-6), f"reduce_scatter native {what}"
                y = data(case, rank, N * n + 1)          # not divisible: native Allreduce
                want = y.clone()
                ref.all_reduce(want)
                got = d(y.clone())
                sc.all_reduce(got)
                assert torch.allclose(got.cpu(), want, rtol=1e-5, atol=1e-6), f"all_reduce native {what}"
                want = y.clone()
                ref.all_reduce(want, op="max")
                got = d(y.clone())
                sc.all_reduce(got, op="max")
                same(got, want, f"all_reduce max {what}")
    if N > 1:
        try:
            sn.all_reduce(d(torch.zeros(N * 3 + 1, dtype=torch.bfloat16)))
            raise AssertionError("native bf16 all_reduce was not refused")
        except TypeError as e:
            assert "cannot reduce" in str(e)
done += ["all_gather", "all_gather_inplace", "all_to_all", "reduce_scatter_ordered", "all_reduce_ordered",
         "gather", "broadcast", "reduce_scatter_native", "all_reduce_native", "all_reduce_max"]

# ---------------------------------------------------------------- the pipeline's order
if N > 1:
    sc = staged(48)
    sc.stager.trace = []
    n = 29
    m = sc.stager.chunk(N + 1, torch.float32)      # all_gather: send m + recv N*m per slot
    x = d(data(999, rank, n))
    out = d(torch.empty(N * n))
    sc.all_gather(x, out)
    k = -(-n // m)
    want = [("pack", 0, 0)]
    for i in range(k):
        if i + 1 < k:
            want.append(("pack", i + 1, (i + 1) % 2))   # copy-in of k+1 before MPI moves k
        want += [("mpi", i, i % 2), ("unpack", i, i % 2)]
    assert sc.stager.trace == want, (sc.stager.trace, want)
    assert k >= 3, k
    details["pipeline"] = {"chunks": k, "chunk_elements": m, "trace": sc.stager.trace[:6]}
    done.append("double_buffer_order")

    # gather goes through the slots too (the unstaged one refuses device tensors)
    sc.stager.trace = []
    sc.gather(x, out if rank == 0 else None, root=0)
    assert [t for t in sc.stager.trace if t[0] == "mpi"] == [("mpi", i, i % 2) for i in range(k)], sc.stager.trace
    done.append("gather_staged")

    # stats: the same conventions as the unstaged communicator
    sc, st = staged(48), MPICommunicator()
    for c in (sc, st):
        z = (lambda k: d(torch.zeros(k))) if c is sc else torch.zeros
        c.all_gather(z(5), z(5 * N))
        c.reduce_scatter(z(4 * N), z(4))
        c.all_reduce(z(3 * N))
    s1, s2 = sc.stats(), st.stats()
    assert {k: v["elements"] for k, v in s1.items()} == {k: v["elements"] for k, v in s2.items()}, (s1, s2)
    assert {k: v["calls"] for k, v in s1.items()} == {k: v["calls"] for k, v in s2.items()}, (s1, s2)
    done.append("stats")

    # split keeps the staging (and the slots)
    sub = staged(48).split(color=rank % 2)
    assert isinstance(sub, StagedMPICommunicator) and sub.stager.slot_bytes == 48
    out = d(torch.empty(3 * sub.size))
    sub.all_gather(d(torch.full((3,), float(rank))), out)
    want = torch.tensor([float(r) for r in range(N) if r % 2 == rank % 2]).repeat_interleave(3)
    same(out, want, "split all_gather")
    done.append("split")

# ---------------------------------------------------------------- choices
assert type(create(backend="mpi", device="cpu")) is MPICommunicator
assert type(create(backend="auto")) is MPICommunicator
c = device_mpi(aware=False, device=dev)
assert isinstance(c, StagedMPICommunicator)
c = device_mpi(aware=True)
assert type(c) is MPICommunicator and c.device_buffers
t = data(5, rank, 4 * N)                     # CUDA-aware mode keeps CPU tensors working
want = t.clone()
ref.all_reduce(want)
c.all_reduce(t)
same(t, want, "device_buffers on CPU tensors")
try:
    create(backend="nccl", device="cpu")
    raise AssertionError("nccl on cpu tensors was accepted")
except ValueError as e:
    assert "config key 'comm.backend' = 'nccl'" in str(e) and "CUDA tensors" in str(e), e
done.append("choices")

if rank == 0:
    details["checks"] = done
    with open(a.out, "w") as f:
        json.dump({"ok": True, **details}, f)
