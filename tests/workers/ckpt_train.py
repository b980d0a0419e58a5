"""Checkpoint worker: runs a list of plans, each on a fresh engine, on N ranks.

--runs is a JSON file: [{"model": "odd", "stage": 2, "precision": "fp32", "plan": [...]}]
with plan steps
  ["train", k]               k optimizer steps; the data of step s is global_batch(s)
  ["save", dir, tag|null]    collective save; client_state carries the data position
  ["load", dir, tag|null]    collective load; continue at the saved data position
  ["load_error", dir, tag]   expect CheckpointError on EVERY rank; record the messages
  ["save_keep", dir, k]      zerompi.checkpoint.save(..., keep_last=k), default tag
  ["save_type_error", dir]   a non-JSON client_state: expect TypeError on EVERY rank
  ["dump", file]             rank 0 writes full_state_dict() to an HDF5 file
  ["rng", key]               record torch/numpy/python random draws of every rank
  ["save_async", dir, tag]   asynchronous save (writer thread); the write goes on meanwhile
  ["flush"]                  zerompi.checkpoint.flush: publish the save in flight
  ["slow_copy", s]           from now on each snapshot's host copy starts s seconds late,
                             so the steps after an asynchronous save must wait for it
Rank 0 writes {"runs": [[outcome per step]]} to --out.
"""
from zerompi.runtime import pause_collector; pause_collector()  # until freeze_startup_heap: runtime/pygc.py
import argparse
import json
import random
import time

import h5py
import numpy as np
import torch
from mpi4py import MPI

import zerompi
import zerompi.checkpoint
from zerompi.checkpoint import CheckpointError
from zerompi.checkpoint.background.snapshot import Snapshot
from common import global_batch, make_model, micro_slices, vocab_of
zerompi.runtime.freeze_startup_heap()  # as zerompi.train does (runtime/pygc.py)

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("--runs", required=True)
ap.add_argument("--rows", type=int, default=24)
ap.add_argument("--seq", type=int, default=8)
ap.add_argument("--gas", type=int, default=2)
ap.add_argument("--lr", type=float, default=1e-2)
ap.add_argument("--clip", type=float, default=0.5)
a = ap.parse_args()

world = MPI.COMM_WORLD
rank, N = world.rank, world.size
with open(a.runs) as f:
    runs = json.load(f)


def train(engine, model, start, k):
    for step in range(start, start + k):
        x, y = global_batch(step, a.rows, a.seq, vocab_of(model))
        for sl in micro_slices(a.rows, a.gas, rank, N):
            _, loss = engine(x[sl], y[sl])
            engine.backward(loss)
            engine.step()
    return start + k


results = []
for spec in runs:
    model = make_model(spec.get("model", "odd"))
    engine = zerompi.initialize(model, {
        "stage": spec["stage"], "precision": spec.get("precision", "fp32"),
        "gradient_accumulation_steps": a.gas, "gradient_clipping": a.clip,
        "bucket_size": spec.get("bucket", 300), "optimizer": {"lr": a.lr, "weight_decay": 0.01}})
    data_step, out = 0, []
    for action in spec["plan"]:
        op = action[0]
        if op == "train":
            data_step = train(engine, model, data_step, action[1])
            out.append({"global_steps": engine.global_steps})
        elif op == "save":
            path = engine.save_checkpoint(action[1], tag=action[2],
                                          client_state={"data_step": data_step, "note": "ckpt test"})
            out.append({"path": path})
        elif op == "save_keep":
            path = zerompi.checkpoint.save(engine, action[1], client_state={"data_step": data_step},
                                           keep_last=action[2])
            out.append({"path": path})
        elif op == "save_type_error":
            try:
                engine.save_checkpoint(action[1], client_state={"data_step": 1, "sampler": {"obj": object()}})
                msg = None
            except TypeError as e:
                msg = str(e)
            out.append({"errors": world.allgather(msg)})
        elif op == "save_async":
            path = zerompi.checkpoint.save(engine, action[1], tag=action[2], async_save=True,
                                           client_state={"data_step": data_step, "note": "ckpt test"})
            out.append({"path": path})
        elif op == "flush":
            rec = zerompi.checkpoint.flush(engine)
            out.append({"published": rec and rec["path"]})
        elif op == "slow_copy":
            copy = Snapshot.copy
            Snapshot.copy = lambda self, _c=copy, _s=action[1]: (time.sleep(_s), _c(self))[1]
            out.append({})
        elif op == "load":
            cs = engine.load_checkpoint(action[1], tag=action[2])
            data_step = cs["data_step"]
            out.append({"client_state": cs, "global_steps": engine.global_steps,
                        "micro_steps": engine.micro_steps})
        elif op == "load_error":
            try:
                engine.load_checkpoint(action[1], tag=action[2])
                msg = None
            except CheckpointError as e:
                msg = str(e)
            out.append({"errors": world.allgather(msg)})
        elif op == "dump":
            sd = engine.full_state_dict()
            if rank == 0:
                with h5py.File(action[1], "w") as f:
                    for n, t in sd.items():
                        f[n.replace("/", "%2F")] = t.numpy()
            out.append({})
        elif op == "rng":
            draws = [torch.rand(3).tolist(), np.random.rand(3).tolist(), [random.random() for _ in range(3)]]
            out.append({"draws": world.allgather(draws)})
        else:
            raise ValueError(f"unknown plan step {op!r}")
    results.append(out)

if rank == 0:
    with open(a.out, "w") as f:
        json.dump({"world": N, "runs": results}, f)
