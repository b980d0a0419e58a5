"""Memory and traffic accounting of one engine per (stage, precision, grad dtype)."""
import argparse
import json

from mpi4py import MPI

import zerompi
from common import global_batch, make_model, micro_slices, vocab_of

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("--bucket", type=int, default=4096)
a = ap.parse_args()
world = MPI.COMM_WORLD
rank, N = world.rank, world.size
cases = [(s, p, "param", 1) for s in (0, 1, 2, 3) for p in ("fp32", "bf16", "fp16")]
cases += [(s, "bf16", "fp32", 1) for s in (0, 1, 2, 3)] + [(2, "fp32", "param", 2), (1, "fp32", "param", 2)]
cases += [(3, "fp32", "param", 2)]
out = []
for stage, prec, gdt, gas in cases:
    model = make_model("gpt")
    eng = zerompi.initialize(model, {"stage": stage, "precision": prec, "grad_accum_dtype": gdt,
                                     "bucket_size": a.bucket, "gradient_accumulation_steps": gas,
                                     "fp16": {"initial_scale": 1024}})
    x, y = global_batch(0, 4 * gas * N, 32, vocab_of(model))
    for measured in (False, True):  # a warm-up step first (stage 3 checks its order then)
        eng.reset_comm_stats()
        for sl in micro_slices(4 * gas * N, gas, rank, N):
            _, loss = eng(x[sl], y[sl])
            eng.backward(loss)
            during = eng.memory_report()  # after backward, before the update
            eng.step()
    after = eng.memory_report()
    extra = {}
    if stage == 3:
        # a unit is gathered by its root module only: nothing is gathered twice
        extra["tied_extra"] = 0
        extra["materialized"] = eng.materialized_params()
    out.append({**extra, "stage": stage, "precision": prec, "grad_accum_dtype": gdt, "gas": gas,
                "updated": eng.global_steps == 2, "mem": after, "mem_before_step": during,
                "comm": eng.comm_stats(), "num_params": len(eng.params),
                "loose_grad_bytes": eng.reducer.loose_grad_bytes()})
    del eng, model
if rank == 0:
    json.dump({"world": N, "bucket": a.bucket, "cases": out}, open(a.out, "w"))
