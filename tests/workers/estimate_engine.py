"""One process, no mpiexec: the real engine's memory_report() and comm_stats() next to the
estimator's dry run of the same model and config (tests/unit/test_estimate.py)."""
import json
import sys

import torch

import zerompi
import zerompi.zero.buckets
from zerompi.estimate.activations import comm_buffer_bytes, working_bytes
from zerompi.estimate.dryrun import DryRun, collectives, rank_state
from zerompi.estimate.models import from_preset
from zerompi.models.gpt import GPT

torch.set_num_threads(1)
spec = from_preset("tiny")
out = []
# (stage, precision, grad dtype, forced bucket policy): the last two force what "auto" does
# above its floor at large N - blocks of at least 60,000 elements, stage-3 units
# coalesced to 60,000 (the model's unit takes in h.0) - in the engine and the dry run alike
CASES = [(s, p, g, None) for s in (0, 1, 2, 3)
         for p, g in (("fp32", "param"), ("bf16", "param"), ("bf16", "fp32"))]
CASES += [(2, "bf16", "param", (60_000, True)), (3, "bf16", "param", (60_000, True))]
real_policy = zerompi.zero.buckets.bucket_policy


def recording(calls, forced):
    """bucket_policy as the engine or the dry run calls it (both through zero/layout.py),
    its arguments kept (the element size "auto" is sized for must come from the run's
    precision in both)."""
    def policy(b, w, **kw):
        calls.append([b, w, kw])
        return real_policy(b, w, **kw) if forced is None else forced
    return policy


for stage, precision, gdt, forced in CASES:
    engine_calls, estimate_calls = [], []
    zerompi.zero.buckets.bucket_policy = recording(engine_calls, forced)
    gas = 2
    cfg = zerompi.load_config({"stage": stage, "precision": precision, "grad_accum_dtype": gdt,
                               "bucket_size": 4096, "gradient_accumulation_steps": gas})
    torch.manual_seed(0)
    eng = zerompi.initialize(GPT(spec.gpt), cfg)
    x = torch.randint(0, spec.gpt.vocab_size, (2, 16))
    for measured in (False, True):  # a warm-up step first (stage 3 records its order then)
        eng.reset_comm_stats()
        for _ in range(gas):
            _, loss = eng(x, x)
            eng.backward(loss)
            eng.step()
    rep = eng.memory_report()
    comm = {op: [v["calls"], v["elements"], v["bytes"]] for op, v in eng.comm_stats().items()}
    zerompi.zero.buckets.bucket_policy = recording(estimate_calls, forced)
    runner = DryRun(spec, cfg)
    built = runner.build(1, stage)
    est = rank_state(built, stage, 0, precision, gdt)
    est_comm = {}
    for r in collectives(built, stage, cfg, precision, gas):
        c = est_comm.setdefault(r["op"], [0, 0, 0])
        c[0] += r["count"]
        c[1] += r["counted_elements"]
        c[2] += r["bytes_per_step"]
    out.append({"stage": stage, "precision": precision, "gdt": gdt, "engine": rep, "estimate": est,
                "engine_buffers": rep["buffers"],
                "estimate_buffers": comm_buffer_bytes(built.layout, cfg.bucket_count,
                                                      4 if cfg.reduce_dtype == "fp32" else 2),
                "engine_gather_pool": rep.get("gather_pool", 0),
                "estimate_gathered": working_bytes(built, stage, cfg, 4 if precision == "fp32" else 2)["gathered"],
                "engine_padded": rep["padded_numel"], "estimate_padded": built.layout.total,
                "engine_comm": comm, "estimate_comm": est_comm, "forced": forced,
                "engine_policy_calls": engine_calls, "estimate_policy_calls": estimate_calls,
                "engine_units": [u.name for u in getattr(eng.param_store, "units", [])],
                "estimate_units": built.plan.unit_names if stage == 3 else [],
                "engine_blocks": eng.layout.blocks, "estimate_blocks": built.layout.blocks})
    del eng
json.dump(out, sys.stdout)
