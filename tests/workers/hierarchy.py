"""Hierarchy modes (zero/groups.py) against single-process torch AdamW, many cases in one
launch. Rank 0 writes {case: result} as JSON; tests/multirank/test_hierarchy_parity.py asserts.

mpiexec -n 4 -env ZEROMPI_RANKS_PER_NODE 2 python hierarchy.py --out r.json
    [--cases fp32/s2/node,...] [--tp 2] [--save DIR] [--load DIR/TAG]

A case is PRECISION/sSTAGE/MODE[/bBUCKET][+save] (MODES below); PREC/sS/MODE<FROM
resumes the checkpoint DIR/FROM (saved by case FROM at step --steps/2) in that mode and
runs the second half. Every rank trains the same reference GPT (vocabulary 300, 2
layers) on the same global batches; the reference and its noise floor (the same batch
summed in pieces, tests/multirank/test_parity.py) are computed by ranks 0 and 1 side by side.
"""
from __future__ import annotations

from zerompi.runtime import pause_collector; pause_collector()  # until freeze_startup_heap: runtime/pygc.py
import argparse
import hashlib
import json
import time

import torch
from mpi4py import MPI

import zerompi
from common import global_batch, make_model, micro_slices, reference_run, vocab_of
from zerompi.models.gpt import GPT, GPTConfig
from zerompi.parallel import ParallelDims
from zerompi.parallel.parallelize import parallelize
zerompi.runtime.freeze_startup_heap()  # as zerompi.train does (runtime/pygc.py)

MODES = {
    "flat": {"comm": {"hierarchical": "off"}},
    "two": {"comm": {"hierarchical": "on"}},
    "node": {"shard_group": "node"},
    "k1": {"shard_group": 1},
    "sec": {"comm": {"hierarchical": "off"}, "stage3": {"secondary_partition": "node"}},
    "sec2": {"comm": {"hierarchical": "on"}, "stage3": {"secondary_partition": "node"}},
}
DEFAULT = ",".join(
    ["fp32/s1/two", "fp32/s1/node", "fp32/s2/two", "fp32/s2/node+save", "fp32/s3/flat", "fp32/s3/sec+save",
     "fp32/s3/two", "fp32/s3/node", "fp32/s3/sec2",
     "bf16/s1/flat", "bf16/s1/two", "bf16/s1/node", "bf16/s2/flat", "bf16/s2/two", "bf16/s2/node",
     "bf16/s3/flat", "bf16/s3/two", "bf16/s3/node+save", "bf16/s3/sec2",
     "fp32/s3/k1", "fp32/s2/two/b300", "fp32/s2/node/b300",  # K = 1; bucket 300 vs the default 2000
     "fp32/s3/sec2<fp32/s2/node", "fp32/s1/two<fp32/s3/sec", "fp32/s3/sec<fp32/s3/sec",
     "bf16/s1/two<bf16/s3/node"])
LR, CLIP, ROWS, SEQ, GAS = 1e-3, 0.05, 24, 16, 2
GPT_CFG = GPTConfig(vocab_size=300, block_size=32, n_layer=2, n_head=4, n_embd=32)

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("--cases", default=DEFAULT)
ap.add_argument("--steps", type=int, default=4)
ap.add_argument("--tp", type=int, default=1)
ap.add_argument("--model", default="gpt", help="gpt (the GPT below) or a tests/workers/common.py model")
ap.add_argument("--unit-classes", default="auto", help="stage3.unit_classes")
ap.add_argument("--save", default=None, help="directory for the +save cases' checkpoints")
ap.add_argument("--load", default=None, help="directory of checkpoints for the <FROM cases")
a = ap.parse_args()
world = MPI.COMM_WORLD
HALF = a.steps // 2


def make():
    if a.model != "gpt":
        return make_model(a.model)  # seeds 0 itself
    torch.manual_seed(0)
    return GPT(GPT_CFG)


VOCAB = GPT_CFG.vocab_size if a.model == "gpt" else vocab_of(make())


def idle_barrier() -> None:
    """Ranks that finished early sleep instead of spinning in MPI (2 cores, 4 ranks)."""
    req = world.Ibarrier()
    while not req.Test():
        time.sleep(0.002)


# reference (rank 0) and floor (rank 1) side by side
job = {0: "ref", 1: "floor"}.get(world.rank if world.size > 1 else 0)
mine = None
if job == "ref" or world.size == 1:
    m = make()
    losses, norms, _ = reference_run(m, a.steps, ROWS, SEQ, LR, CLIP)
    mine = {"ref": {n: p.detach().clone() for n, p in m.named_parameters()}, "losses": losses, "norms": norms}
if job == "floor" or world.size == 1:
    fm = make()
    reference_run(fm, a.steps, ROWS, SEQ, LR, CLIP, micro=ROWS)
    mine = dict(mine or {}, floor={n: p.detach().clone() for n, p in fm.named_parameters()})
idle_barrier()
parts = world.gather(mine, root=0)
result: dict = {"world": world.size, "tp": a.tp}
if world.rank == 0:
    got = {k: v for d in parts if d for k, v in d.items()}
    REF = got["ref"]
    result["ref_losses"], result["ref_norms"] = got["losses"], got["norms"]
    result["floor"] = max((got["floor"][n] - p).abs().max().item() for n, p in REF.items())


FLAT: dict = {}  # rank 0: "prec/sS" -> the flat run's full state


def run_case(case: str) -> dict:
    save = case.endswith("+save")
    spec, _, src = case.removesuffix("+save").partition("<")
    prec, stage, mode, *rest = spec.split("/")
    stage = int(stage[1:])
    bucket = int(rest[0][1:]) if rest else 2000
    cfg = {"stage": stage, "precision": prec, "gradient_accumulation_steps": GAS, "gradient_clipping": CLIP,
           "bucket_size": bucket, "tensor_parallel_size": a.tp, "optimizer": {"lr": LR, "weight_decay": 0.01},
           **MODES[mode]}
    cfg["stage3"] = dict(cfg.get("stage3", {}), unit_classes=a.unit_classes)
    dims = ParallelDims.create(tp_size=a.tp)
    model = parallelize(make(), dims.tp) if a.tp > 1 else make()
    engine = zerompi.initialize(model, cfg, dims=dims)
    t_init = time.perf_counter()
    first = 0
    if src:
        engine.load_checkpoint(f"{a.load}/{src.replace('/', '-')}")
        first = HALF
    losses, norms, stats = [], [], None
    for step in range(first, a.steps):
        if step == a.steps - 1:
            engine.reset_comm_stats()  # one whole step's traffic
        x, y = global_batch(step, ROWS, SEQ, VOCAB)
        tot = 0.0
        for sl in micro_slices(ROWS, GAS, dims.dp_rank, dims.dp_size):
            _, loss = engine(x[sl], y[sl])
            engine.backward(loss)
            tot += loss.item()
            engine.step()
        losses.append(world.allreduce(tot) / (world.size * GAS))  # not on dp: comm_stats() stays the engine's
        norms.append(engine.last_grad_norm)
        if stage == 3:
            assert not engine.materialized_params(), engine.materialized_params()
        if save and step == HALF - 1:
            engine.save_checkpoint(a.save, tag=spec.replace("/", "-"))
    stats = engine.comm_stats()
    sd = engine.full_state_dict()
    sec = getattr(engine.param_store, "secondary", None)
    fills = world.allreduce(sec.fills if sec is not None else 0)
    foreign = world.allreduce(getattr(engine.param_store, "foreign", 0))  # units gathered only for a peer
    out = None
    if world.rank == 0:
        base = FLAT.setdefault(f"{prec}/s{stage}", sd) if mode == "flat" and not src else FLAT.get(f"{prec}/s{stage}")
        out = {"losses": losses, "train_seconds": time.perf_counter() - t_init, "norms": norms, "mode": engine.groups.mode,
               "group": engine.groups.size, "replicas": engine.groups.replicas,
               "max_diff": max((sd[n] - p).abs().max().item() for n, p in REF.items()),
               # against the flat run of this precision and stage (run earlier in the list)
               "diff_flat": None if base is None else max((sd[n] - base[n]).abs().max().item() for n in sd),
               "digest": hashlib.sha256(b"".join(sd[n].numpy().tobytes() for n in sorted(sd))).hexdigest(),
               "memory": engine.memory_report(), "comm": {k: v["elements"] for k, v in stats.items()},
               "secondary_fills": fills, "foreign": foreign, "describe": engine.groups.describe()}
    return out


for case in a.cases.split(","):
    t0 = time.perf_counter()
    r = run_case(case)
    if world.rank == 0:
        result[case] = dict(r, seconds=time.perf_counter() - t0)
idle_barrier()
if world.rank == 0:
    with open(a.out, "w") as f:
        json.dump(result, f)
