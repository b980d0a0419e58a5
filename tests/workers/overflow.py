"""fp16 overflow on ONE rank: every rank must skip the same step and lower the scale."""
import argparse
import json

import torch
from mpi4py import MPI

import zerompi
from common import global_batch, make_model, micro_slices, vocab_of

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("--stage", type=int, default=2)
a = ap.parse_args()
world = MPI.COMM_WORLD
rank, N = world.rank, world.size
model = make_model("gpt")
eng = zerompi.initialize(model, {"stage": a.stage, "precision": "fp16",
                                 "fp16": {"initial_scale": 256, "hysteresis": 1, "window": 2}})
log = []
for step in range(6):
    x, y = global_batch(step, 2 * N, 16, vocab_of(model))
    (sl,) = micro_slices(2 * N, 1, rank, N)
    _, loss = eng(x[sl], y[sl])
    if step == 2 and rank == N - 1:
        loss = loss * float("inf")  # only the last rank overflows
    before = eng.full_state_dict(all_ranks=True)
    eng.backward(loss)
    updated = eng.step()
    after = eng.full_state_dict(all_ranks=True)
    same = all(torch.equal(before[k], after[k]) for k in before)
    log.append({"updated": updated, "scale": eng.loss_scale, "unchanged": same,
                "skipped": eng.skipped_steps})
logs = world.allgather(log)
if rank == 0:
    json.dump({"logs": logs}, open(a.out, "w"))
