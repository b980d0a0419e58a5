"""Collectives of MPICommunicator against locally computed expectations.

Rank r's input for a case is drawn from a generator seeded by (case, r), so every rank
can rebuild all ranks' inputs and compute the global result itself: exact (bitwise) for
data movement, max, and the 'ordered' sum (which must equal ((x0 + x1) + x2) + ... in
rank order), and within the fp32 summation error bound for MPI's native sums (their
order is MPICH's choice; see close()).
A failed assertion aborts every rank (`python -m mpi4py`); rank 0 writes the JSON.
"""
import argparse
import json
import time

import numpy as np
import torch
from mpi4py import MPI
from spread import ordered_sum
from spread import data as _data

from zerompi.comm import DoneHandle, Handle, MPICommunicator
from zerompi.zero.partition import FlatLayout

torch.set_num_threads(1)

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
a = ap.parse_args()

rank, N = MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size
comm = MPICommunicator()                           # ordered reduce-scatter (default)
native = MPICommunicator(reduce_scatter="native")
done: list[str] = []
details: dict = {"world": N}


def data(case: int, r: int, n: int, dtype=torch.float32) -> torch.Tensor:
    return _data(case, r, n, dtype, base=10_000)


def exact_sum(xs):
    return torch.stack([x.double() for x in xs]).sum(0)


U32 = 2.0 ** -24  # unit roundoff of fp32


def close(got, xs):
    """An fp32 sum of the N terms xs in SOME order is within rounding of the exact sum.

    Whatever the order (rank order, a tree, MPICH's choice), every term passes through at
    most N-1 fp32 additions, so |got - sum| <= gamma_{N-1} * sum|x_i| with
    gamma_k = k*u / (1 - k*u) (Higham, Accuracy and Stability, 4.2). The float64
    reference adds at most N * 2^-53 * sum|x_i| of its own. With one term nothing is
    added: got must equal it. Returns (ok, worst ratio of error to bound)."""
    k = len(xs) - 1
    ref = exact_sum(xs)
    scale = torch.stack([x.double().abs() for x in xs]).sum(0)
    bound = (k * U32 / (1 - k * U32) + len(xs) * 2.0 ** -53) * scale + 2.0 ** -149
    ratio = ((got.double() - ref).abs() / bound)
    worst = float(ratio.max()) if ratio.numel() else 0.0
    return bool((ratio <= 1).all()), worst


def assert_close(got, xs, what):
    ok, worst = close(got, xs)
    assert ok, f"{what}: error {worst:.3g} x the fp32 summation bound"


def bits(x):
    return x.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()])


def bitwise(x, y):
    # compare bit patterns: NaN-safe, and -0.0 != 0.0
    return x.dtype == y.dtype and x.shape == y.shape and torch.equal(bits(x), bits(y))


case = iter(range(1, 10_000))  # a fresh seed for every input

# ---------------------------------------------------------------- all_reduce
c = next(case)
n = 37 * N                                    # divisible: ordered reduce-scatter + gather
xs = [data(c, r, n) for r in range(N)]
t = xs[rank].clone()
comm.all_reduce(t)
assert bitwise(t, ordered_sum(xs)), "all_reduce ordered path not the rank-ordered sum"
assert_close(t, xs, "all_reduce ordered path")
done.append("all_reduce_sum_ordered")

c = next(case)
n = 37 * N + 1                                # not divisible: native Allreduce
xs = [data(c, r, n) for r in range(N)]
t = xs[rank].clone()
comm.all_reduce(t)
assert_close(t, xs, "all_reduce native path")
t = xs[rank].clone()
native.all_reduce(t)                          # native communicator, any size
assert_close(t, xs, "native all_reduce")
done.append("all_reduce_sum_native")

for op, fn in (("max", torch.maximum), ("min", torch.minimum)):
    c = next(case)
    xs = [data(c, r, 8 * N) for r in range(N)]  # divisible size: must not take the sum path
    t = xs[rank].clone()
    comm.all_reduce(t, op=op)
    want = xs[0].clone()
    for x in xs[1:]:
        want = fn(want, x)
    assert torch.equal(t, want), f"all_reduce {op}"
    done.append(f"all_reduce_{op}")

c = next(case)
xs = [data(c, r, 11, torch.float64).numpy() for r in range(N)]
arr = xs[rank].copy()
comm.all_reduce(arr)                          # numpy buffers go through MPI directly
assert np.allclose(arr, np.sum(xs, axis=0), rtol=1e-12, atol=0)
done.append("all_reduce_numpy")

# ---------------------------------------------------------------- reduce_scatter
for name, cm, dtype in (("ordered_fp32", comm, torch.float32), ("native_fp32", native, torch.float32),
                        ("ordered_bf16", comm, torch.bfloat16)):
    c = next(case)
    n = 29
    xs = [data(c, r, N * n, dtype) for r in range(N)]
    recv = torch.full((n,), float("nan"), dtype=dtype)
    cm.reduce_scatter(xs[rank], recv)
    mine = slice(rank * n, (rank + 1) * n)
    if cm is comm:
        assert bitwise(recv, ordered_sum(xs)[mine]), f"reduce_scatter {name}"
    else:
        assert_close(recv, [x[mine] for x in xs], f"reduce_scatter {name}")
    done.append(f"reduce_scatter_{name}")

if N > 1:  # MPI has no bf16 sum: the native path must refuse it (on every rank alike)
    try:
        native.reduce_scatter(torch.zeros(N * 4, dtype=torch.bfloat16), torch.zeros(4, dtype=torch.bfloat16))
        raise AssertionError("native bf16 reduce_scatter did not raise")
    except TypeError:
        pass
    done.append("reduce_scatter_native_bf16_refused")

# ---------------------------------------------------------------- all_gather
for dtype in (torch.float32, torch.bfloat16):
    c = next(case)
    n = 13
    xs = [data(c, r, n, dtype) for r in range(N)]
    want = torch.cat(xs)
    recv = torch.full((N * n,), float("nan"), dtype=dtype)
    comm.all_gather(xs[rank], recv)
    assert bitwise(recv, want), f"all_gather out of place {dtype}"
    recv = torch.full((N * n,), float("nan"), dtype=dtype)
    recv[rank * n:(rank + 1) * n] = xs[rank]
    comm.all_gather(recv[rank * n:(rank + 1) * n], recv)  # send is a view of recv's block
    assert bitwise(recv, want), f"all_gather in place {dtype}"
    done.append(f"all_gather_{str(dtype).split('.')[-1]}")

# ---------------------------------------------------------------- broadcast
for root in sorted({0, N - 1}):
    c = next(case)
    t = data(c, rank, 17)
    comm.broadcast(t, root=root)
    assert bitwise(t, data(c, root, 17)), f"broadcast root {root}"
    tb = data(c, rank, 5, torch.bfloat16)
    comm.broadcast(tb, root=root)
    assert bitwise(tb, data(c, root, 5, torch.bfloat16))
done.append("broadcast")

# ---------------------------------------------------------------- allreduce_scalars
got = comm.allreduce_scalars([float(rank), 1.0, 0.5 * rank, -float(rank)])
assert got == [N * (N - 1) / 2, float(N), 0.25 * N * (N - 1), -N * (N - 1) / 2], got
assert comm.allreduce_scalars([float(rank), -float(rank)], op="max") == [N - 1.0, 0.0]
assert comm.allreduce_scalars([float(rank)], op="min") == [0.0]
done.append("allreduce_scalars")

# ---------------------------------------------------------------- async handles
c = next(case)
ar_x = [data(c, r, 16 * N) for r in range(N)]           # ordered all_reduce (has a finish step)
ar2_x = [data(c + 5000, r, 16 * N + 3) for r in range(N)]  # native all_reduce
rs_x = [data(c + 6000, r, 7 * N) for r in range(N)]
ag_x = [data(c + 7000, r, 9) for r in range(N)]
t_ar, t_ar2 = ar_x[rank].clone(), ar2_x[rank].clone()
rs_out = torch.empty(7)
ag_out = torch.empty(9 * N)
handles = [comm.all_reduce(t_ar, async_op=True), comm.all_reduce(t_ar2, async_op=True),
           comm.reduce_scatter(rs_x[rank], rs_out, async_op=True),
           comm.all_gather(ag_x[rank], ag_out, async_op=True)]
assert all(isinstance(h, Handle) for h in handles)
if N == 1:
    assert all(isinstance(h, DoneHandle) for h in handles)
deadline = time.monotonic() + 60
while not all([h.test() for h in handles]):  # test() drives progress, never blocks
    assert time.monotonic() < deadline, "async collectives never completed under test()"
for h in reversed(handles):
    h.wait()
    assert h.done and h.test()
    h.wait()                                      # idempotent
assert bitwise(t_ar, ordered_sum(ar_x))
assert_close(t_ar2, ar2_x, "async native all_reduce")
assert bitwise(rs_out, ordered_sum(rs_x)[rank * 7:(rank + 1) * 7])
assert bitwise(ag_out, torch.cat(ag_x))
done.append("async_reverse_wait")

# ---------------------------------------------------------------- split
color = rank % 2
sub = comm.split(color)
members = [r for r in range(N) if r % 2 == color]
assert sub.size == len(members) and sub.rank == members.index(rank), (sub.size, sub.rank)
c = next(case)
xs = [data(c, r, 6 * sub.size) for r in members]
t = xs[sub.rank].clone()
sub.all_reduce(t)
assert bitwise(t, ordered_sum(xs)), "split all_reduce"
recv = torch.empty(6)
sub.reduce_scatter(xs[sub.rank], recv)
assert bitwise(recv, ordered_sum(xs)[sub.rank * 6:(sub.rank + 1) * 6]), "split reduce_scatter"
g = torch.empty(6 * sub.size * sub.size)
sub.all_gather(xs[sub.rank], g)
assert bitwise(g, torch.cat(xs)), "split all_gather"
ss = sub.stats()  # a sub-communicator counts its own traffic only
assert [ss[k]["calls"] for k in ("all_reduce", "reduce_scatter", "all_gather")] == [1, 1, 1], ss
done.append("split_even_odd")

# ---------------------------------------------------------------- stats convention
st = MPICommunicator()
assert st.stats() == {}
n = 4 * N
st.all_reduce(torch.zeros(n))                                  # 2n
st.all_reduce(torch.zeros(n + 1, dtype=torch.float64))          # 2(n+1), 8 bytes each
st.reduce_scatter(torch.zeros(N * 3), torch.zeros(3))           # input N*3
st.reduce_scatter(torch.zeros(N * 5, dtype=torch.bfloat16), torch.zeros(5, dtype=torch.bfloat16))
st.all_gather(torch.zeros(6), torch.zeros(6 * N))               # output 6N
st.broadcast(torch.zeros(10))
st.allreduce_scalars([1.0, 2.0, 3.0])                           # counted as all_reduce 2*3
s = st.stats()
assert s["all_reduce"]["calls"] == 3 and s["all_reduce"]["elements"] == 2 * n + 2 * (n + 1) + 6, s
assert s["all_reduce"]["bytes"] == 4 * 2 * n + 8 * 2 * (n + 1) + 8 * 6, s
assert s["reduce_scatter"]["calls"] == 2 and s["reduce_scatter"]["elements"] == N * 8, s
assert s["reduce_scatter"]["bytes"] == 4 * N * 3 + 2 * N * 5, s
assert s["all_gather"] == {**s["all_gather"], "calls": 1, "elements": 6 * N, "bytes": 24 * N}, s
assert s["broadcast"]["calls"] == 1 and s["broadcast"]["elements"] == 10, s
assert all(v["seconds"] >= 0 for v in s.values())
st.reset_stats()
assert st.stats() == {}
details["stats_example"] = s
done.append("stats")

# ---------------------------------------------------------------- size mismatch
# Checked before any traffic and before counting, so every rank raises the same
# ValueError and the communicator stays usable (no rank is left inside a collective).
for call in (lambda: st.reduce_scatter(torch.zeros(N * 4 + 1), torch.zeros(4)),
             lambda: st.reduce_scatter(torch.zeros(N * 4), torch.zeros(5)),
             lambda: st.all_gather(torch.zeros(4), torch.zeros(4 * N + 1)),
             lambda: native.reduce_scatter(torch.zeros(N * 4 - 1), torch.zeros(4))):
    try:
        call()
        raise AssertionError("size mismatch did not raise")
    except ValueError as e:
        assert "expected" in str(e), e
assert st.stats() == {}, st.stats()
t = torch.full((N,), float(rank))
st.all_reduce(t)
assert torch.equal(t, torch.full((N,), N * (N - 1) / 2))
done.append("size_mismatch_raises")

# ---------------------------------------------------------------- bucket independence
# The reason for 'ordered': reducing one big buffer, or the same buffer bucket by bucket
# as the engine does (each block cut into N equal chunks, rank r keeps chunk r), must
# give bitwise the same sum for every element. The native algorithm promises less: every
# element within fp32 rounding of the exact sum (asserted for the whole buffer and for
# every chunk); how many elements differ from the ordered sum is recorded per block
# size, with how many were compared, for the test to check (its value is MPICH's).
c = next(case)
numels = [1, 997, 0, 4099, 31, 2, 1021]
mismatch_native = {}
for req_block in (1, 64, 300, 1000, 4096, 10**9):
    L = FlatLayout(numels, N, req_block, align=4)
    xs = [data(c, r, L.total) for r in range(N)]
    full = ordered_sum(xs)
    n = L.shard_size
    big = torch.empty(n)
    comm.reduce_scatter(xs[rank], big)                  # one bucket: contiguous rank ranges
    assert bitwise(big, full[rank * n:(rank + 1) * n])
    shard = torch.empty(n)
    nshard = torch.empty(n)
    scratch = torch.empty(L.block)
    for ch in L.chunks(rank):                           # bucket by bucket
        s, e = L.blocks[ch.block]
        comm.reduce_scatter(xs[rank][s:e], shard[ch.shard_lo:ch.shard_lo + ch.size], scratch=scratch)
        native.reduce_scatter(xs[rank][s:e], nshard[ch.shard_lo:ch.shard_lo + ch.size])
        assert bitwise(shard[ch.shard_lo:ch.shard_lo + ch.size], full[ch.flat_lo:ch.flat_hi])
    # gather both results back to flat order and compare the whole buffers bitwise
    g_big = torch.empty(L.total)
    comm.all_gather(big, g_big)
    g_shards = torch.empty(L.total).view(N, n)
    comm.all_gather(shard, g_shards.view(-1))
    g_blocks = torch.empty(L.total)
    for q in range(N):
        for ch in L.chunks(q):
            g_blocks[ch.flat_lo:ch.flat_hi] = g_shards[q, ch.shard_lo:ch.shard_lo + ch.size]
    assert bitwise(g_big, g_blocks), f"ordered reduce_scatter depends on bucket size {req_block}"
    # native: whole buffer and every chunk within rounding of the exact sum
    nbig = torch.empty(n)
    native.reduce_scatter(xs[rank], nbig)
    assert_close(nbig, [x[rank * n:(rank + 1) * n] for x in xs], f"native reduce_scatter, block {req_block}")
    diff = compared = 0
    for ch in L.chunks(rank):
        part = nshard[ch.shard_lo:ch.shard_lo + ch.size]
        ref = [x[ch.flat_lo:ch.flat_hi] for x in xs]
        assert_close(part, ref, f"native per-bucket reduce_scatter, block {req_block}, chunk {ch}")
        diff += int((bits(part) != bits(full[ch.flat_lo:ch.flat_hi])).sum())
        compared += ch.size
    assert compared == n, f"chunks of rank {rank} cover {compared} of its {n} shard elements"
    diff, compared = comm.allreduce_scalars([float(diff), float(compared)])
    mismatch_native[str(req_block)] = {"block": L.block, "total": L.total,
                                       "compared": compared, "differing": diff}
done.append("bucket_independence")
details["native_elements_differing_from_ordered"] = mismatch_native

# barrier(poll=True) waits for the last rank without spinning: the early ranks use little CPU
if rank == N - 1:
    time.sleep(0.3)
w0, c0 = time.perf_counter(), time.process_time()
comm.barrier(poll=True)
wait, cpu = time.perf_counter() - w0, time.process_time() - c0
if rank < N - 1:
    assert wait > 0.25, f"barrier(poll=True) returned after {wait:.3f} s, before the last rank arrived"
    assert cpu < 0.05, f"barrier(poll=True) used {cpu:.3f} CPU-s in a {wait:.3f} s wait (spinning?)"
done.append("barrier_poll")

details["checks"] = done
details["stats"] = comm.stats()
if rank == 0:
    with open(a.out, "w") as f:
        json.dump({"ok": True, **details}, f)
