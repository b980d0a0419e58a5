"""Process grid, communicator protocol and engine-over-a-group checks (any N).

- ParallelDims.create(tp_size): tp groups are adjacent ranks, dp groups stride by tp.
- all_to_all moves block q of every rank's send to rank q.
- Handle.wait(timeout) raises CommTimeout while a peer is late, then completes.
- An engine built on dims.dp (tp = 2: two independent dp groups) trains each group
  alone: both groups end with identical parameters, equal to a dp-only run's.
"""
import argparse
import json
import time

import torch

import zerompi
from common import global_batch, make_model, micro_slices, vocab_of
from zerompi.comm import CommTimeout, Communicator
from zerompi.parallel import ParallelDims

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("--tp", type=int, default=1)
a = ap.parse_args()

dims = ParallelDims.create(tp_size=a.tp)
W, r = dims.world.size, dims.rank
res = {"world": W, "rank": r, "tp_rank": dims.tp_rank, "tp_size": dims.tp_size,
       "dp_rank": dims.dp_rank, "dp_size": dims.dp_size,
       "protocol": all(isinstance(c, Communicator) for c in (dims.world, dims.dp, dims.tp))}
# group membership as world ranks, seen from inside each group
res["tp_members"] = dims.tp.allgather_object(r)
res["dp_members"] = dims.dp.allgather_object(r)

# all_to_all: rank q receives block q of every rank, in rank order
n = 3
send = torch.arange(W * n, dtype=torch.float32) + 1000 * r
recv = torch.empty(W * n)
dims.world.all_to_all(send, recv)
expect = torch.cat([torch.arange(r * n, (r + 1) * n, dtype=torch.float32) + 1000 * q for q in range(W)])
res["all_to_all"] = bool(torch.equal(recv, expect))
res["all_to_all_counted"] = dims.world.stats()["all_to_all"]["elements"] == W * n

# a late peer: rank 0's wait with a deadline times out, a later wait completes
if W > 1:
    buf = torch.full((4,), float(r))
    out = torch.empty(4 * W)
    if r != 0:
        time.sleep(1.0)
    h = dims.world.all_gather(buf, out, async_op=True)
    timed_out = False
    if r == 0:
        try:
            h.wait(timeout=0.2)
        except CommTimeout as e:
            timed_out = "all_gather" in str(e)
    h.wait(timeout=30)
    res["timeout_seen_on_rank0"] = timed_out if r == 0 else None
    res["gather_after_timeout"] = out.tolist() == [float(q) for q in range(W) for _ in range(4)]

# an engine partitions over dims.dp only
cfg = {"stage": 2, "bucket_size": 64, "optimizer": {"lr": 1e-2}}
model = make_model("odd")
eng = zerompi.initialize(model, cfg, dims=dims)
res["engine_comm_is_dp"] = eng.comm is dims.dp and eng.world == dims.dp_size
rows = 4 * dims.dp_size
for step in range(3):
    x, y = global_batch(step, rows, 8, vocab_of(model))
    for sl in micro_slices(rows, 1, dims.dp_rank, dims.dp_size):
        _, loss = eng(x[sl], y[sl])
        eng.backward(loss)
        eng.step()
sd = eng.full_state_dict(all_ranks=True)
flat = torch.cat([sd[k].reshape(-1) for k in sorted(sd)])
everyone = dims.world.allgather_object(flat.tolist())
res["tp_replicas_identical"] = all(v == everyone[0] for v in everyone)
if r == 0:
    res["params"] = everyone[0]
all_res = dims.world.allgather_object(res)
if r == 0:
    json.dump(all_res, open(a.out, "w"))
