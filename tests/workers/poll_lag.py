"""An asynchronous save's per-step poll while one rank is late to every step boundary.

Each step is a training step of the engine (its collectives), then rank 1 works LAG
seconds longer than the others before it polls. Rank 0 records how long each of its
polls took and at which step every rank saw the save published."""
import argparse
import json
import time

import torch
from mpi4py import MPI

import zerompi
from zerompi.checkpoint import poll, save
from zerompi.checkpoint.background import writers as background

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("--dir", required=True)
ap.add_argument("--lag", type=float, default=0.1)
ap.add_argument("--write-s", type=float, default=1.0, help="the background write takes this long")
a = ap.parse_args()
_write = background.ThreadWriter.write


def slow_write(self, *args):
    time.sleep(a.write_s)   # a real model's write: many steps in flight
    return _write(self, *args)


background.ThreadWriter.write = slow_write
world = MPI.COMM_WORLD
torch.manual_seed(0)
engine = zerompi.initialize(torch.nn.Linear(64, 64), {"stage": 2})
save(engine, a.dir, tag="a", async_save=True, writer="thread")
polls, published = [], None
for step in range(400):
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(step))
    engine.backward(engine(x).square().mean())
    engine.step()
    time.sleep(0.02 + (a.lag if world.rank == 1 else 0.0))
    t0 = time.perf_counter()
    rec = poll(engine)
    polls.append(time.perf_counter() - t0)
    if rec is not None:
        published = step
        break
steps = world.gather(published)
if world.rank == 0:
    with open(a.out, "w") as f:
        json.dump({"polls": polls, "published": steps}, f)
