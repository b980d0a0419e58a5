"""Tensor-parallel (x data-parallel) training of the reference GPT against single-process
torch.optim.AdamW on the same global batches (rank 0 writes the comparison as JSON).

mpiexec -n N python tp_parity.py --out r.json --tp 2 --stages 0,1,2,3 [--act partition]
    [--save DIR] [--load DIR --start 3]
Each tp group gets the same micro-batch; dp ranks split it (common.micro_slices). With
--load, the run resumes from DIR at step --start and the reference runs all steps.
"""
from __future__ import annotations

import argparse
import json

import torch
from mpi4py import MPI

import zerompi
from common import global_batch, micro_slices, reference_run
from zerompi.models.gpt import GPT, GPTConfig
from zerompi.models.llama import Llama, LlamaConfig
from zerompi.parallel.parallelize import parallelize
from zerompi.parallel import ParallelDims
from zerompi.zero.tensor_parallel_state import assemble_full

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("--tp", type=int, default=2)
ap.add_argument("--stages", default="0,1,2,3")
ap.add_argument("--precision", default="fp32")
ap.add_argument("--steps", type=int, default=3)
ap.add_argument("--start", type=int, default=0, help="first step (with --load)")
ap.add_argument("--gas", type=int, default=2)
ap.add_argument("--rows", type=int, default=24)
ap.add_argument("--seq", type=int, default=16)
ap.add_argument("--vocab", type=int, default=300, help="not a multiple of 128 x tp: padding is exercised")
ap.add_argument("--act", default="none", help="activation checkpointing: none | plain | partition | offload")
ap.add_argument("--impl", default="auto", help="optimizer.implementation")
# ~12 blocks of the 37k-element model: parameters still straddle blocks; 300 (hundreds of
# blocks) cost 3x the time at stage 3 on 4 ranks sharing 2 cores, for no other coverage
# (bucket-size invariance: tests/multirank/test_buckets.py)
ap.add_argument("--bucket", type=int, default=3000, help="bucket_size")
ap.add_argument("--family", default="gpt", help="gpt | llama (GQA: 4 query heads, 2 kv heads)")
ap.add_argument("--save", default=None)
ap.add_argument("--load", default=None)
a = ap.parse_args()

world = MPI.COMM_WORLD
LR, CLIP = 1e-3, 1.0
GPT_CFG = GPTConfig(vocab_size=a.vocab, block_size=32, n_layer=2, n_head=4, n_embd=32)
LLAMA_CFG = LlamaConfig(vocab_size=a.vocab, block_size=32, n_layer=2, n_head=4, n_kv_head=2, n_embd=32,
                        intermediate_size=64)


def make():
    torch.manual_seed(0)
    return Llama(LLAMA_CFG) if a.family == "llama" else GPT(GPT_CFG)


def estimate(stage: int, zcfg, dims) -> dict:
    """What `python -m zerompi.estimate --dry-run --tp` lays out for this rank (tp rank 0,
    dp rank 0): memory_report()'s terms, the padded T, the bucket buffers, stage 3's pool."""
    from zerompi.estimate.activations import comm_buffer_bytes, working_bytes
    from zerompi.estimate.dryrun import DryRun, rank_state, reduce_bytes
    from zerompi.estimate.models import from_shape
    from zerompi.precision import DTYPES

    built = DryRun(from_shape("tp worker", GPT_CFG), zcfg, a.tp).build(dims.dp_size, stage)
    est = rank_state(built, stage, dims.dp_rank, a.precision, zcfg.grad_accum_dtype)
    return {**{k: est[k] for k in ("params", "grads", "master", "optimizer", "model_states")},
            "padded_numel": built.layout.total,
            "buffers": comm_buffer_bytes(built.layout, zcfg.bucket_count, reduce_bytes(zcfg, a.precision)),
            "gather_pool": working_bytes(built, stage, zcfg, DTYPES[a.precision].itemsize)["gathered"]}


result = {"world": world.size, "tp": a.tp}
if world.rank == 0:
    ref = make()
    losses, norms, grads0 = reference_run(ref, a.start + a.steps, a.rows, a.seq, LR, CLIP,
                                           grad_step=a.start)
    floor_model = make()
    reference_run(floor_model, a.start + a.steps, a.rows, a.seq, LR, CLIP, micro=a.rows)
    refp = dict(ref.named_parameters())
    result["ref_losses"], result["ref_norms"] = losses[a.start:], norms[a.start:]
    result["floor"] = max((p - refp[n]).abs().max().item() for n, p in floor_model.named_parameters())

ACT = {"none": None, "plain": {"enabled": True},
       "partition": {"enabled": True, "partition": True},
       "offload": {"enabled": True, "partition": True, "cpu_offload": True, "contiguous": True}}
for stage in [int(s) for s in a.stages.split(",")]:
    cfg = {"stage": stage, "precision": a.precision, "gradient_accumulation_steps": a.gas,
           "gradient_clipping": CLIP, "bucket_size": a.bucket, "tensor_parallel_size": a.tp,
           "optimizer": {"lr": LR, "weight_decay": 0.01, "implementation": a.impl}}
    if ACT[a.act] is not None:
        cfg["activation_checkpointing"] = ACT[a.act]
    dims = ParallelDims.create(tp_size=a.tp)
    model = parallelize(make(), dims.tp)
    init_local = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine = zerompi.initialize(model, cfg, dims=dims)
    if a.load:
        engine.load_checkpoint(a.load)
    losses, norms, grad_err = [], [], None
    for step in range(a.start, a.start + a.steps):
        x, y = global_batch(step, a.rows, a.seq, a.vocab)
        tot = 0.0
        for sl in micro_slices(a.rows, a.gas, dims.dp_rank, dims.dp_size):
            _, loss = engine(x[sl], y[sl])
            engine.backward(loss)
            tot += loss.item()
            if step == a.start and engine.is_boundary():  # the first step's reduced gradient, full shape
                full = assemble_full(engine.full_grads(), dict(zip(engine.param_names, engine.params)),
                                     dims.tp, root_only=True)
                if world.rank == 0:
                    total = sum(g.norm() ** 2 for g in grads0.values()) ** 0.5
                    grad_err = max(((full[n] - g).norm() / g.norm().clamp_min(1e-6 * total)).item()
                                   for n, g in grads0.items())
            engine.step()
        losses.append(dims.dp.allreduce_scalars([tot])[0] / (dims.dp_size * a.gas))
        norms.append(engine.last_grad_norm)
    if a.save:
        engine.save_checkpoint(a.save, tag=f"s{stage}")
    sd = engine.full_state_dict()
    key = f"stage{stage}"
    if world.rank == 0:
        assert sd.keys() == refp.keys(), (sorted(sd), sorted(refp))
        result[key] = {"max_diff": max((sd[n] - p.detach()).abs().max().item() for n, p in refp.items()),
                       "losses": losses, "norms": norms,
                       "grad_rel_err": grad_err,
                       "shapes_full": all(tuple(sd[n].shape) == tuple(p.shape) for n, p in refp.items())}
    # tp-invariant initialisation: this rank's local weights are slices of the plain model's
    from zerompi.parallel.tp_layout import local_index

    plain = dict(make().named_parameters())
    bad = [n for n, p in model.named_parameters()
           if not torch.equal(init_local[n], local_index(p, plain[n].detach()))]
    bad = world.allgather(bad)
    if world.rank == 0:
        result[key]["init_mismatch"] = sorted({n for b in bad for n in b})
        result[key]["memory"] = engine.memory_report()
        if a.tp > 1 and a.family == "gpt":  # the estimator knows GPT shapes; (at tp 1 this worker still pads the vocabulary; the train command does not split)
            result[key]["estimate"] = estimate(stage, zerompi.load_config(cfg), dims)
if world.rank == 0:
    with open(a.out, "w") as f:
        json.dump(result, f)
