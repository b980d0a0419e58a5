"""bench_multinode.py's per-rank worker, run by mpiexec across simulated nodes: for each
ZeRO stage, real training steps (step time, bytes that left each node per step from the
node's own eth0 counters) and a replay of one step's collectives without compute (the
communication time, and its bytes), exactly the collectives `zerompi.estimate` lists
for the step, on the engine's own communicators (so two-level ones run in two levels);
the replay's per-op calls and elements are checked against the engine's. Each stage
records the mode the engine chose (zero/groups.py: flat or two-level here).

    mpiexec ... python benchmarks/multinode_worker.py --out RESULT.json --stages 0,1,2,3 --hierarchical auto
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from bench_env import machine_info, quiet_barrier, software_info


def eth0_bytes() -> tuple[int, int]:
    """(rx, tx) of this network namespace's eth0 (/proc/self/net is per namespace)."""
    with open("/proc/self/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == "eth0":
                v = rest.split()
                return int(v[0]), int(v[8])
    return 0, 0


def node_tx(world, node) -> list[int]:
    """Every node's eth0 tx bytes now (node-local rank 0 reads, all ranks get the list)."""
    quiet_barrier(world)
    mine = eth0_bytes()[1] if node.Get_rank() == 0 else None
    return [x for x in world.allgather(mine) if x is not None]


def replay_plan(rows, n: int):
    """Buffers for one step's collectives as the estimator lists them, allocated and
    filled before the clock starts (a step's buckets and parameters exist already)."""
    import torch

    big = max(r["elements"] for r in rows if not r["scalars"])
    return {"send": torch.rand(big), "scratch": torch.empty(big), "recv": torch.empty(big // n),
            "full": torch.rand(big)}


def replay(groups, rows, bufs, n: int) -> None:
    """One step's collectives as the estimator lists them, blocking, in sequence, each on
    the communicator the engine uses for it (zero/groups.py ShardGroups): the reducer's
    for reduce-scatters, the shard group's for all-gathers (into the shard index's
    place), the data-parallel group for stage 0's all-reduce and the scalars."""
    pos = groups.shard_rank
    for r in rows:
        e = r["elements"]
        for _ in range(r["count"]):
            if r["scalars"]:
                groups.dp.allreduce_scalars([1.0] * e)
            elif r["op"] == "reduce_scatter":
                groups.reduce.reduce_scatter(bufs["send"][:e], bufs["recv"][:e // n], scratch=bufs["scratch"])
            elif r["op"] == "all_gather":
                full = bufs["full"][:e]
                groups.shard.all_gather(full[pos * (e // n):(pos + 1) * (e // n)], full)
            else:
                groups.dp.all_reduce(bufs["send"][:e], scratch=bufs["scratch"])


def run_stage(args, stage: int, world, node) -> dict:
    import torch
    from mpi4py import MPI

    import zerompi
    from zerompi.config import ZeroConfig
    from zerompi.estimate import api
    from zerompi.models.gpt import GPT, PRESETS

    rank, n = world.Get_rank(), world.Get_size()
    gcfg = PRESETS[args.model]
    torch.manual_seed(0)
    engine = zerompi.initialize(GPT(gcfg), {"stage": stage, "precision": "fp32",
                                            "optimizer": {"lr": 1e-4, "weight_decay": 0.1},
                                            "comm": {"hierarchical": args.hierarchical}})
    if engine.groups.mode not in ("flat", "two-level"):
        raise SystemExit(f"the replay covers flat and two-level runs, not {engine.groups.mode}")

    def batch(i):
        g = torch.Generator().manual_seed(1000 * rank + i)
        t = torch.randint(0, gcfg.vocab_size, (args.micro_batch, args.seq_len + 1), generator=g)
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()

    walls, waits = [], []
    for i in range(args.warmup):
        x, y = batch(i)
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.step()
    tx0 = node_tx(world, node)
    for i in range(args.steps):
        x, y = batch(args.warmup + i)
        quiet_barrier(world)
        engine.reset_comm_stats()
        t0 = time.perf_counter()
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        walls.append(world.allreduce(time.perf_counter() - t0, op=MPI.MAX))
        waits.append(world.allreduce(sum(v["seconds"] for v in engine.comm_stats().values())) / n)
    tx1 = node_tx(world, node)
    step_stats = engine.comm_stats()

    zc = ZeroConfig(stage=stage, precision="fp32")  # the logical collectives: the same in both modes
    rows = api.size(args.model, [n], [stage], zero=zc, seq_len=args.seq_len)["runs"][0]["collectives"]
    comm = engine.comm
    bufs = replay_plan(rows, n)
    replays = []
    for k in range(args.replays + 1):
        t_a = node_tx(world, node)
        comm.reset_stats()
        t0 = time.perf_counter()
        replay(engine.groups, rows, bufs, n)
        wall = world.allreduce(time.perf_counter() - t0, op=MPI.MAX)
        t_b = node_tx(world, node)
        if k:  # the first is a warm-up
            replays.append({"seconds": wall, "node_tx": [b - a for a, b in zip(t_a, t_b)]})
    rep_stats = comm.stats()
    same = {op: (step_stats.get(op, {}).get("calls"), step_stats.get(op, {}).get("elements"),
                 rep_stats.get(op, {}).get("calls"), rep_stats.get(op, {}).get("elements"))
            for op in sorted(set(step_stats) | set(rep_stats))}
    res = {"stage": stage, "mode": engine.groups.mode, "describe": engine.groups.describe(),
           "params": sum(p.numel() for p in engine.module.parameters()),
           "step_wall_s": walls, "step_median_s": statistics.median(walls),
           "step_comm_wait_s": waits,
           "node_tx_per_step": [(b - a) / args.steps for a, b in zip(tx0, tx1)],
           "replay": replays, "replay_median_s": statistics.median(r["seconds"] for r in replays),
           "replay_node_tx": [statistics.median(r["node_tx"][i] for r in replays) for i in range(len(tx0))],
           "ops_step_vs_replay": same,
           "replay_matches_step": all(a == c and b == d for a, b, c, d in same.values())}
    del engine
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="small")
    ap.add_argument("--stages", default="0,1,2,3")
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--replays", type=int, default=2)
    ap.add_argument("--hierarchical", choices=("auto", "on", "off"), default="auto",
                    help="zero.comm.hierarchical of the engine")
    args = ap.parse_args()
    import torch
    from mpi4py import MPI

    from zerompi.parallel.nodes import discover

    torch.set_num_threads(1)
    world = MPI.COMM_WORLD
    node = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.Get_rank())
    layout = discover(world)
    out = {"ranks": world.Get_size(), "nodes": layout.count, "per_node": layout.per_node,
           "hosts": list(layout.names), "model": args.model, "micro_batch": args.micro_batch,
           "seq_len": args.seq_len, "steps": args.steps, "replays": args.replays,
           "hierarchical": args.hierarchical, "stages": []}
    for s in map(int, args.stages.split(",")):
        out["stages"].append(run_stage(args, s, world, node))
        if world.Get_rank() == 0:
            d = out["stages"][-1]
            print(f"  stage {s} ({d['mode']}): step {d['step_median_s']:.3f} s, node tx/step "
                  f"{[round(x / 2**20, 2) for x in d['node_tx_per_step']]} MiB, replay "
                  f"{d['replay_median_s']:.3f} s, matches step: {d['replay_matches_step']}", flush=True)
    if world.Get_rank() == 0:
        out.update(machine=machine_info(), software=software_info(), loadavg_end=os.getloadavg())
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
