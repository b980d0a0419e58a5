"""The delayed offload update on N ranks against the same delay applied by hand to an
engine without it (tests/workers/offload_runs.py), every stage: rank 0 writes per stage
whether losses, norms and final parameters are bitwise equal, and the plain run's losses."""
from zerompi.runtime import pause_collector; pause_collector()  # until freeze_startup_heap: runtime/pygc.py
import argparse
import json

import torch
from mpi4py import MPI

import zerompi
from offload_runs import run
zerompi.runtime.freeze_startup_heap()

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("--stages", default="0,1,2,3")
ap.add_argument("--steps", type=int, default=4)
a = ap.parse_args()
world = MPI.COMM_WORLD
result = {"world": world.size}
for stage in map(int, a.stages.split(",")):
    kw = dict(steps=a.steps, rank=world.rank, world=world.size)
    d, e, p = run(stage, True, **kw), run(stage, False, emulate=True, **kw), run(stage, False, **kw)
    if world.rank == 0:
        result[f"stage{stage}"] = {
            "same_losses": d["losses"] == e["losses"], "same_norms": d["norms"] == e["norms"],
            "same_params": all(torch.equal(d["params"][k], e["params"][k]) for k in d["params"]),
            "losses": d["losses"], "plain_losses": p["losses"],
            "optimizer": type(d["engine"].optimizer).__name__}
if world.rank == 0:
    with open(a.out, "w") as f:
        json.dump(result, f)
