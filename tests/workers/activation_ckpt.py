"""Activation checkpointing worker (zerompi/parallel/activations.py).

Part 1 (engine): the tiny GPT (fp32, dropout on) trained for a few steps through
zerompi.initialize at each stage, with every checkpointing variant and without; rank 0
writes losses, max |param - uncheckpointed param|, memory_report entries and the
checkpointing counters. --tp 2 builds ParallelDims.create(tp_size=2) (dp = N / 2) and
passes it as dims=, so Pa partitions over a real tp group of 2 (the model itself is
replicated over tp: tensor-parallel layers are another module's job).

Part 2 (direct, --direct): blocks with an odd hidden size, an extra tensor keyword
argument that needs a gradient, a non-tensor argument and a tuple output, checkpointed
by activations.apply over dims.tp; gradients against the plain run, kept bytes per rank.
"""
import argparse
import dataclasses
import json

import torch
import torch.nn as nn
from mpi4py import MPI

import zerompi
from zerompi.device import Placement
from zerompi.parallel import ParallelDims, activations
from common import global_batch, micro_slices

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("--tp", type=int, default=1)
ap.add_argument("--stages", default="0,1,2,3")
ap.add_argument("--variants", default="plain,pa,pa_cpu,pa_cpu_contig,contig")
ap.add_argument("--steps", type=int, default=3)
ap.add_argument("--gas", type=int, default=2)
ap.add_argument("--rows", type=int, default=8)
ap.add_argument("--seq", type=int, default=16)
ap.add_argument("--dropout", type=float, default=0.1)
ap.add_argument("--direct", action="store_true")
ap.add_argument("--coalesce", type=int, default=0, help="stage3.coalesce_elements of the checkpointed runs")
a = ap.parse_args()

VARIANTS = {"off": {}, "plain": {"enabled": True}, "pa": {"enabled": True, "partition": True},
            "pa_cpu": {"enabled": True, "partition": True, "cpu_offload": True},
            "pa_cpu_contig": {"enabled": True, "partition": True, "cpu_offload": True, "contiguous": True},
            "contig": {"enabled": True, "contiguous": True}}

world = MPI.COMM_WORLD
rank = world.rank
dims = ParallelDims.create(tp_size=a.tp)
result = {"world": world.size, "tp": dims.tp_size, "dp": dims.dp_size}


def train(stage: int, variant: str) -> dict:
    from zerompi.models.gpt import GPT, PRESETS

    torch.manual_seed(0)
    model = GPT(dataclasses.replace(PRESETS["tiny"], dropout=a.dropout))
    cfg = {"stage": stage, "gradient_accumulation_steps": a.gas, "bucket_size": 4096,
           "gradient_clipping": 1.0, "activation_checkpointing": VARIANTS[variant]}
    if a.coalesce and variant != "off":  # the reference keeps one unit per layer
        cfg["stage3"] = {"coalesce_elements": a.coalesce}
    eng = zerompi.initialize(model, cfg, dims=dims)
    dims.tp.reset_stats()
    losses, gathers = [], []
    for step in range(a.steps):
        x, y = global_batch(step, a.rows, a.seq, 256)
        tot = 0.0
        for sl in micro_slices(a.rows, a.gas, dims.dp_rank, dims.dp_size):
            _, loss = eng(x[sl], y[sl])
            eng.backward(loss)
            eng.step()
            tot += loss.item()
        losses.append(dims.dp.allreduce_scalars([tot])[0] / (dims.dp_size * a.gas))
        if eng.activations is not None:
            gathers.append(eng.activations.stats()["gather_elements"])
            eng.activations.reset_gather_stats()
    rep = eng.memory_report()
    out = {"losses": losses, "sd": eng.full_state_dict(),
           "mem": {k: rep[k] for k in ("activation_ckpt_device", "activation_ckpt_host")},
           "stats": eng.activations.stats() if eng.activations is not None else None,
           "gather_per_step": gathers,
           "tp_all_gather": dims.tp.stats().get("all_gather", {}).get("elements", 0),
           "materialized": eng.materialized_params(),
           "units": [u.name for u in getattr(eng.param_store, "units", [])]}
    if eng.activations is not None:
        eng.activations.remove()
    return out


if not a.direct:
    for stage in map(int, a.stages.split(",")):
        ref = train(stage, "off")
        for v in a.variants.split(","):
            r = train(stage, v)
            per_rank = world.allgather({"mem": r["mem"], "stats": r["stats"]})
            if rank == 0:
                diff = max((r["sd"][k] - t).abs().max().item() for k, t in ref["sd"].items())
                result[f"stage{stage}/{v}"] = {
                    "losses": r["losses"], "ref_losses": ref["losses"], "max_diff": diff,
                    "per_rank": per_rank, "gather_per_step": r["gather_per_step"],
                    "tp_all_gather": r["tp_all_gather"], "materialized": r["materialized"],
                    "units": r["units"]}
else:
    class Blk(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.lin, self.drop = nn.Linear(d, d), nn.Dropout(0.2)

        def forward(self, x, flag, scale=None):
            assert flag == "on"
            h = x + self.drop(torch.tanh(self.lin(x))) * scale
            return h, {"n": h.shape[0]}

    class Net(nn.Module):
        def __init__(self, d=13):
            super().__init__()
            self.inp = nn.Linear(d, d)
            self.blocks = nn.ModuleList(Blk(d) for _ in range(3))

        def forward(self, x, scale):
            h = self.inp(x)
            for b in self.blocks:
                h, info = b(h, "on", scale=scale)
                assert info["n"] == x.shape[0]
            return h.square().mean()

    def run(variant):
        torch.manual_seed(0)
        net = Net()
        acts = (activations.apply(net, zerompi.load_config({"activation_checkpointing": VARIANTS[variant]})
                                  .activation_checkpointing, dims.tp, Placement())
                if variant != "off" else None)
        x = torch.randn(5, 7, 13)  # 455 elements per block input: odd, so tp = 2 pads
        scale = torch.tensor(0.7, requires_grad=True)
        dims.tp.reset_stats()
        torch.manual_seed(1)  # dropout: the same on every rank and in every run
        for _ in range(2):    # twice: the second pass reuses the arena
            net.zero_grad()
            scale.grad = None
            loss = net(x, scale)
            mid = acts.stats() if acts else None
            loss.backward()
        grads = {n: p.grad.clone() for n, p in net.named_parameters()}
        grads["scale"] = scale.grad.clone()
        return loss.item(), grads, mid, (acts.stats() if acts else None), dims.tp.stats()

    l0, g0, _, _, _ = run("off")
    for v in a.variants.split(","):
        l1, g1, mid, end, tps = run(v)
        per_rank = world.allgather({"mid": mid, "end": end})
        if rank == 0:
            result[v] = {"loss_diff": abs(l1 - l0),
                         "grad_diff": max((g1[k] - g0[k]).abs().max().item() for k in g0),
                         "per_rank": per_rank, "tp_all_gather": tps.get("all_gather", {}).get("elements", 0)}
if rank == 0:
    with open(a.out, "w") as f:
        json.dump(result, f)
