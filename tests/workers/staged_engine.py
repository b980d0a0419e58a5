"""A stage-0..3 engine over host-staged MPI (StagedMPICommunicator with CPU tensors
standing in for device memory, tiny slots) against the same engine over plain MPI:
losses and full_state_dict() bitwise equal, and the consolidation's gather went
through the staging slots (on a GPU it must: mpi.py refuses device tensors). Then the
other paths that move model state, all over staged MPI: a checkpoint saved and loaded
into an engine built from other weights, load_full_state_dict, full_grads.
Rank 0 writes the JSON."""
import argparse
import json
from pathlib import Path

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


def config(stage: int) -> dict:
    return {"stage": stage, "gradient_accumulation_steps": 2, "bucket_size": 300}


def train(stage: int, dims) -> tuple[list[float], dict, int, object]:
    """Losses, full_state_dict(), the staged MPI steps the consolidation took, the engine."""
    model = make_model("odd")
    engine = zerompi.initialize(model, config(stage), dims=dims)
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
    return losses, sd, 0 if dims is None else sum(t[0] == "mpi" for t in dims.dp.stager.trace), engine


def same(a: dict, b: dict) -> list[str]:
    """Keys whose tensors differ (rank 0 holds the dicts)."""
    assert a.keys() == b.keys()
    return [k for k in a if not torch.equal(a[k], b[k])]


result = {"world": N}
for stage in map(int, a.stages.split(",")):
    plain_losses, plain, _, plain_engine = train(stage, None)
    dims = staged_dims()
    losses, sd, consolidation_steps, engine = train(stage, dims)
    assert losses == plain_losses, (stage, losses, plain_losses)
    grads, plain_grads = engine.full_grads(), plain_engine.full_grads()
    if rank == 0:
        assert not same(sd, plain), stage
        assert not same(grads, plain_grads), stage
    ck = Path(a.out).parent / f"ck-stage{stage}"
    engine.save_checkpoint(ck)
    restored = zerompi.initialize(make_model("odd", seed=1), config(stage), dims=staged_dims())
    restored.load_checkpoint(ck)
    loaded = zerompi.initialize(make_model("odd", seed=2), config(stage), dims=staged_dims())
    loaded.load_full_state_dict(sd if rank == 0 else None, strict=False)  # sd holds no buffers
    sd_restored, sd_loaded = restored.full_state_dict(), loaded.full_state_dict()
    if rank == 0:
        assert not same(sd_restored, sd) and not same(sd_loaded, sd), stage
    ops = dims.dp.stats()
    result[f"stage{stage}"] = {"consolidation_staged_steps": consolidation_steps,
                               "gathers": ops.get("gather", {}).get("calls", 0), "ops": sorted(ops)}
if rank == 0:
    with open(a.out, "w") as f:
        json.dump(result, f)
