"""Bucket-size invariance: the same run with several bucket sizes must give bitwise
identical parameters (and identical parameters on every rank)."""
import argparse
import hashlib
import json

import torch
from mpi4py import MPI

import zerompi
import zerompi.zero.buckets
from common import global_batch, make_model, micro_slices, vocab_of

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("--buckets", default="64,1000,100000,300+",
                help="bucket sizes; N+ lays out blocks of at least N (as 'auto' does at large N)")
ap.add_argument("--precision", default="fp32")
ap.add_argument("--stages", default="0,1,2")
a = ap.parse_args()
world = MPI.COMM_WORLD
rank, N = world.rank, world.size
res = {}
# Restored at the end: in a batched launch (tests/workers/batch.py) the cases after this
# one would otherwise run with the forced policy.
default_policy = zerompi.zero.buckets.bucket_policy
try:
    for stage in [int(s) for s in a.stages.split(",")]:
        for spec in a.buckets.split(","):
            bucket, at_least = int(spec.rstrip("+")), spec.endswith("+")
            # the engine's policy, forced: blocks >= the bucket (FlatLayout at_least)
            zerompi.zero.buckets.bucket_policy = lambda b, w, _p=(bucket, at_least), **_: _p
            model = make_model("odd")
            eng = zerompi.initialize(model, {"stage": stage, "precision": a.precision, "bucket_size": bucket,
                                             "gradient_accumulation_steps": 2, "gradient_clipping": 0.05,
                                             "optimizer": {"lr": 1e-2}})
            for step in range(6):
                x, y = global_batch(step, 24, 16, vocab_of(model))
                for sl in micro_slices(24, 2, rank, N):
                    _, loss = eng(x[sl], y[sl])
                    eng.backward(loss)
                    eng.step()
            sd = eng.full_state_dict()
            # The working (full) parameters every rank computes with must agree across ranks.
            fp = eng.state.flat_param
            local = hashlib.sha256(fp.view(torch.uint8).numpy().tobytes()).hexdigest()
            hashes = world.allgather(local)
            if rank == 0:
                h = hashlib.sha256()
                for k in sorted(sd):
                    h.update(k.encode()); h.update(sd[k].numpy().tobytes())
                res[f"{stage}/{spec}"] = {"master": h.hexdigest(), "ranks_agree": len(set(hashes)) == 1,
                                            "blocks": len(eng.layout.blocks),
                                            "block_sizes": sorted({e - s for s, e in eng.layout.blocks})}
finally:
    zerompi.zero.buckets.bucket_policy = default_policy

if rank == 0:
    json.dump(res, open(a.out, "w"))
