"""Sizing one concrete run: everything a rank holds, the largest micro-batch that fits,
and what one step moves through each collective and how long that takes.

Exact terms (they equal what the engine allocates and counts): model states at the padded
element count T of the engine's own layout (the dry run checks them against a
ShardState), the communication buffers, and the collectives per step (counting as
comm_stats() does). Estimates: activations (activations.py), stage-3 gathered units and
transient gradients, and the communication time (the alpha-beta model of cost_model.py).
"""
from __future__ import annotations

import math

from ..precision import DTYPES
from ..comm import cost_model
from .activations import STRATEGIES, activation_bytes, comm_buffer_bytes, largest_micro_batch, working_bytes
from .dryrun import DryRun, collective_summary, collectives, reduce_bytes
from .hierarchy import secondary_bytes
from .memory import model_states
from .models import ModelSpec


def comm_time(rows: list[dict], n: int, link, k: int | None = None) -> dict:
    """Predicted time of one step's collectives, one after another (no overlap), per row
    and in total, with the latency (alpha) share, every rank on `link`. Each runs on its
    group: the shard group's k ranks (default N), a hybrid chunk's all-reduce on the N / k
    replicas, the step's small scalar all-reduce on all N as a tree (recursive doubling,
    what MPI uses for a few bytes). Across nodes: hierarchy.py."""
    k = k or n
    total = lat = 0.0
    by_op: dict[str, float] = {}
    per_row = []
    for r in rows:
        group = n if r["scalars"] else n // k if r["op"] == "all_reduce" and k < n else k
        sec, l_ = cost_model.collective_time(r["op"], r["nbytes"], group, link, "tree" if r["scalars"] else "ring")
        per_row.append({"seconds_each": sec, "latency_each": l_, "seconds": sec * r["count"], "ranks": group})
        total += sec * r["count"]
        lat += l_ * r["count"]
        by_op[r["op"]] = by_op.get(r["op"], 0.0) + sec * r["count"]
    return {"link": {"name": link.name, "alpha": link.alpha, "beta": link.beta},
            "seconds": total, "latency_seconds": lat,
            "latency_fraction": lat / total if total > 0 else 0.0, "by_op": by_op, "rows": per_row}


def micro_batch_for(global_batch: int | None, n: int, gas: int) -> int | None:
    """Sequences per rank and micro-step in train.py (the largest share when uneven)."""
    return None if global_batch is None else max(1, math.ceil(global_batch / (n * gas)))


def size_run(spec: ModelSpec, runner: DryRun, n: int, *, stage: int, precision: str = "bf16",
             grad_accum_dtype: str = "param", gas: int = 1, tp: int = 1, bucket: int | None = None,
             micro_batch: int | None = None, global_batch: int | None = None,
             mem_per_rank: int | None = None, link=None, plan=None) -> dict:
    """One (model, N, stage) sized. `runner` lays out the parameters the engine partitions
    (spec's GPT, with tp > 1 one tp rank's share of it; a bare count is a flat vector);
    `spec` gives the activations. `plan`
    (zero/groups.py GroupPlan, hierarchy.plan_for): the run's groups; states are
    partitioned over its shard group, stage 3 adds its secondary copies (default: flat)."""
    zcfg = runner.zcfg
    group = plan.k if plan is not None else n
    built = runner.build(n, stage, bucket, precision, k=group)
    layout = built.layout
    pbytes, rbytes = DTYPES[precision].itemsize, reduce_bytes(zcfg, precision)
    T = layout.total
    states = model_states(T, group, stage, precision, grad_accum_dtype)
    secondary = secondary_bytes(built, plan, precision) if plan is not None else 0
    buffers = comm_buffer_bytes(layout, zcfg.bucket_count, rbytes)
    # A bare count is one flat parameter: no modules, so no stage-3 units or gradients
    # of its own size to hold; the working memory is then not estimated (0).
    structured = runner.spec.gpt is not None
    work = working_bytes(built, stage, zcfg, pbytes) if structured else \
        {"gathered": 0, "persistent": 0, "transient_grads": 0}
    fixed = states["model_states"] + buffers + sum(work.values()) + secondary
    out = {"N": n, "stage": stage, "precision": precision, "grad_accum_dtype": grad_accum_dtype,
           "gas": gas, "tp": tp, "shard_group": group, "replicas": n // group, "secondary_bytes": secondary,
           "params": sum(built.numels), "padded": T, "bucket": built.bucket,
           "at_least": layout.at_least, "block": layout.block,
           "blocks": len(layout.blocks), "model_states": states, "buffers": buffers, **work,
           "fixed": fixed, "work_estimated": structured}
    if micro_batch is None:
        micro_batch = micro_batch_for(global_batch, n, gas)
    act1 = activation_bytes(spec, 1, precision, tp)
    if act1 is not None:
        mb = micro_batch or 1
        act = activation_bytes(spec, mb, precision, tp)
        out["micro_batch"] = mb
        out["micro_batch_from"] = ("--micro-batch" if micro_batch and global_batch is None else
                                   f"global_batch {global_batch} / (N x GAS)" if global_batch else "default 1")
        out["seq"] = spec.seq
        out["activations"] = {k: {**act[k], "total_device": fixed + act[k]["device"]} for k in STRATEGIES}
        if mem_per_rank is not None:
            fit = {}
            for k in STRATEGIES:
                b = largest_micro_batch(mem_per_rank, fixed, act1[k]["device"])
                fit[k] = {"micro_batch": b,
                          "gas_for_global_batch": (math.ceil(global_batch / (n * b)) if b and global_batch
                                                   else None)}
            out["fit"] = {"mem_per_rank": mem_per_rank, "by_strategy": fit,
                          "model_states_fit": fixed <= mem_per_rank}
    elif mem_per_rank is not None:
        out["fit"] = {"mem_per_rank": mem_per_rank, "by_strategy": None, "model_states_fit": fixed <= mem_per_rank}
    rows = collectives(built, stage, zcfg, precision, gas)
    out["collectives"] = rows
    out["summary"] = collective_summary(rows)
    if link is not None:
        out["comm_time"] = comm_time(rows, n, link, group)
    return out
