"""A stage-0..3 engine over host-staged MPI (StagedMPICommunicator with CPU tensors
standing in for device memory, tiny slots) against the same engine over plain MPI:
losses and full_state_dict() bitwise equal, and the consolidation's gather went
through the staging slots (on a GPU it must: mpi.py refuses device tensors).
Rank 0 writes the JSON."""
import argparse
import json

import torch
from mpi4py import MPI

import zerompi
from common import global_batch, make_model, micro_slices, vocab_of
from zerompi.comm.staged import StagedMPICommunicator
from zerompi.parallel import ParallelDims

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("--stages", default="0,1,2,3")
a = ap.parse_args()
rank, N = MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size


def staged_dims() -> ParallelDims:
    world = StagedMPICommunicator(slot_bytes=256, stage_cpu=True)
    return ParallelDims(world=world, dp=world.split(0), tp=world.split(rank))


def train(stage: int, dims) -> tuple[list[float], dict, int]:
    """Losses, full_state_dict() and the staged MPI steps the consolidation took."""
    model = make_model("odd")
    engine = zerompi.initialize(model, {"stage": stage, "gradient_accumulation_steps": 2, "bucket_size": 300},
                                dims=dims)
    losses = []
    for step in range(3):
        x, y = global_batch(step, 8, 8, vocab_of(model))
        for sl in micro_slices(8, 2, rank, N):
            _, loss = engine(x[sl], y[sl])
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    if dims is not None:
        dims.dp.stager.trace = []
    sd = engine.full_state_dict()
    return losses, sd, 0 if dims is None else sum(t[0] == "mpi" for t in dims.dp.stager.trace)


result = {"world": N}
for stage in map(int, a.stages.split(",")):
    plain_losses, plain, _ = train(stage, None)
    dims = staged_dims()
    losses, sd, consolidation_steps = train(stage, dims)
    assert losses == plain_losses, (stage, losses, plain_losses)
    if rank == 0:
        assert sd.keys() == plain.keys()
        bad = [k for k in sd if not torch.equal(sd[k], plain[k])]
        assert not bad, (stage, bad)
    ops = dims.dp.stats()
    result[f"stage{stage}"] = {"consolidation_staged_steps": consolidation_steps,
                               "gathers": ops.get("gather", {}).get("calls", 0), "ops": sorted(ops)}
if rank == 0:
    with open(a.out, "w") as f:
        json.dump(result, f)
