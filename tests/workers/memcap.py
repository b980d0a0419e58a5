"""Train under a per-rank address-space cap: argv --stage S [--init] --budget-mb M.

The cap is RLIMIT_AS = (address space after start-up) + budget, so it bounds what the
model, its states and the step may add. Prints the peak it observed when it finishes."""
from zerompi.runtime import pause_collector; pause_collector()  # until freeze_startup_heap: runtime/pygc.py
import argparse
import json
import resource

import torch
import torch.nn as nn
from mpi4py import MPI

import zerompi
zerompi.runtime.freeze_startup_heap()  # as zerompi.train does (runtime/pygc.py)

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("--stage", type=int, required=True)
ap.add_argument("--init", action="store_true")
ap.add_argument("--budget-mb", type=float, required=True)
ap.add_argument("--width", type=int, default=1024)
ap.add_argument("--layers", type=int, default=24)
a = ap.parse_args()
rank, N = MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size


def vm_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmSize:"))


def build():
    return nn.Sequential(*[nn.Linear(a.width, a.width) for _ in range(a.layers)])


cfg = {"stage": a.stage, "bucket_size": 1 << 18}
zerompi.initialize(nn.Linear(2, 2), {"stage": a.stage})  # warm up lazy imports and MPI
base = vm_bytes()
cap = base + int(a.budget_mb * 2**20)
resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
if a.init:
    with zerompi.Init(cfg):
        model = build()
else:
    model = build()
full_fp32 = 4 * sum(p.numel() for p in model.parameters())
engine = zerompi.initialize(model, cfg)
for step in range(2):
    x = torch.randn(4, a.width)
    loss = engine(x).pow(2).mean()
    engine.backward(loss)
    engine.step()
peak = vm_bytes() - base
if rank == 0:
    json.dump({"full_fp32_bytes": full_fp32, "budget": cap - base, "vm_used": peak}, open(a.out, "w"))
