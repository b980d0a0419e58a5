"""One training step on a GPU, profiled: which CUDA synchronisations it calls.

Writes (rank 0) per stage the counts of cudaDeviceSynchronize and of stream/event
synchronisations the CUDA runtime saw during one engine forward/backward/step (after
two warm-up steps), as recorded by torch.profiler inside a record_function range around
the step (sync_count.py: the profiler's own synchronise at exit is not counted).
Python-level device-wide synchronises (torch.cuda.synchronize, cupy's
runtime.deviceSynchronize) raise while the step runs."""
import argparse
import json

import torch
from mpi4py import MPI
from torch.profiler import ProfilerActivity, profile

import zerompi
from common import global_batch, make_model, micro_slices, vocab_of
from sync_count import profiled

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("--stages", default="0,1,2,3")
ap.add_argument("--precision", default="bf16")
a = ap.parse_args()

world = MPI.COMM_WORLD
rank, N = world.rank, world.size
dev = torch.device("cuda", rank % torch.cuda.device_count())
torch.cuda.set_device(dev)


def one_step(engine, batch, gas):
    x, y = batch  # made before the measured range: its host-to-device copy waits for the stream
    for sl in micro_slices(8 * N, gas, rank, N):
        _, loss = engine(x[sl], y[sl])
        engine.backward(loss)
        engine.step()


result = {"world": N}
for stage in map(int, a.stages.split(",")):
    model = make_model("gpt").to(dev)
    engine = zerompi.initialize(model, {"stage": stage, "precision": a.precision,
                                        "gradient_accumulation_steps": 2, "gradient_clipping": 1.0})
    batches = [global_batch(s, 8 * N, 32, vocab_of(engine.module), dev) for s in range(3)]
    for s in range(2):
        one_step(engine, batches[s], 2)
    torch.cuda.current_stream().synchronize()  # outside the measured step
    counts = profiled(lambda: one_step(engine, batches[2], 2),
                      lambda: profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]))
    result[f"stage{stage}"] = {**counts, "optimizer": type(engine.optimizer).__name__,
                               "backend": type(engine.comm).__name__, "defer_stats": engine.defer_stats}
    del engine, model
if rank == 0:
    with open(a.out, "w") as f:
        json.dump(result, f)
