"""Disk full during a save (tests/system/test_reliability.py): DIR is on a small tmpfs. Save
checkpoint a, then rank 0 fills the filesystem until half of a's size is left, train
a step and save b: every rank must get CheckpointError, DIR must hold a (intact) and no
temporary directory. argv: DIR OUT [sync|async]. async: b is written in the background
while training goes on; the failure must surface in the same step's poll on every rank.
"""
from zerompi.runtime import pause_collector; pause_collector()  # until freeze_startup_heap: runtime/pygc.py
import json
import os
import sys
import time

import torch
from mpi4py import MPI

import zerompi
from zerompi.checkpoint import CheckpointError, poll, verify_checkpoint
zerompi.runtime.freeze_startup_heap()  # as zerompi.train does (runtime/pygc.py)

d, out = sys.argv[1], sys.argv[2]
mode = sys.argv[3] if len(sys.argv) > 3 else "sync"
world = MPI.COMM_WORLD
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 64))
engine = zerompi.initialize(model, {"stage": 2})


def step():
    loss = engine(torch.randn(4, 64)).pow(2).mean()
    engine.backward(loss)
    engine.step()


step()
engine.save_checkpoint(d, tag="a")
size = sum(os.path.getsize(os.path.join(d, "a", f)) for f in os.listdir(os.path.join(d, "a")))
if world.rank == 0:
    st = os.statvfs(d)
    with open(os.path.join(os.path.dirname(d), "filler"), "wb") as f:
        f.write(b"\0" * max(0, st.f_bavail * st.f_frsize - size // 2))
world.Barrier()
step()
err, at = None, None
try:
    engine.save_checkpoint(d, tag="b", async_save=mode == "async")
    for at in range(2000):   # async: training goes on, a poll per step (the same count on every rank)
        step()
        time.sleep(0.002)     # tiny steps: leave the low-priority writer some time
        poll(engine)
except CheckpointError as e:
    err = str(e)
errs, ats = world.gather(err), world.gather(at)
if world.rank == 0:
    verify_checkpoint(d)  # latest -> a, complete
    with open(out, "w") as f:
        json.dump({"errors": errs, "steps": ats, "listing": sorted(os.listdir(d)), "size_a": size,
                   "latest": open(os.path.join(d, "latest")).read().strip()}, f)
