#!/usr/bin/env python
"""ZeRO across nodes: the bytes that cross the inter-node link per step and the step
time, per layout, link rate, hierarchy mode and stage, beside what the estimator
(zerompi.estimate: api.size with ranks_per_node and one link per node) predicts for the
mode the engine ran. Simulated nodes (tests/support/netcluster.py: network namespaces, a
bridge, `tc tbf` shaping what leaves each node; needs root).

    sudo python benchmarks/bench_nodes.py --layouts 1x4,2x2 --rates 100,400 --modes flat,auto \
        --stages 0,1,2,3 --replays 5 --out benchmarks/results/nodes_vm_202612.json
    python benchmarks/bench_nodes.py --replot benchmarks/results/nodes_vm_202612.json
    python benchmarks/bench_nodes.py --smoke --out /tmp/nodes.json      # seconds: the CI check

One mpiexec job per (layout, rate, mode) runs every stage: warm-up steps, then measured
steps timed between sleeping barriers (slowest rank), the bytes each node's eth0 sent
read by the node's first rank around them. With --replays R (flat and two-level modes),
R replays of one step's collectives without compute, exactly the rows the estimator
lists, on the engine's own communicators, time the communication alone (the estimator's
time is compared with that). Targets: bytes per node within 10% of the prediction, the
replay's time within 30% either way. Before each job the driver waits for other
processes to leave the cores alone (--max-busy) and records how much of the machine they
used meanwhile.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from harness import (ROOT, ForeignCpu, launch, machine_title, pyplot, quiet_barrier, record, save_figure,
                     wait_quiet, write_json)

PAYLOAD_SHARE = 1448 / 1514  # TCP payload per wire byte, full frames, MTU 1500, timestamps on
BYTES_TOL, TIME_TOL = 0.10, 0.30
MODES = {  # name -> zero.* settings
    "auto": {"comm": {"hierarchical": "auto"}},
    "flat": {"comm": {"hierarchical": "off"}},
    "two-level": {"comm": {"hierarchical": "on"}},
    "hybrid node": {"shard_group": "node"},
    "secondary": {"comm": {"hierarchical": "off"}, "stage3": {"secondary_partition": "node"}},
    "secondary + two-level": {"comm": {"hierarchical": "on"}, "stage3": {"secondary_partition": "node"}},
}
REPLAYABLE = ("flat", "two-level")  # the replay runs a step's rows on the dp/shard/reduce groups
# name -> (GPTConfig keyword arguments or a preset name, micro-batch, sequence length)
MODELS = {"small": ("small", 2, 128), "tiny": ("tiny", 1, 32),
          # six 0.79M layers (3.2 MB fp32 units: ring all-gathers), compute small next to the link
          "gpt-4.8m": (dict(vocab_size=256, block_size=128, n_layer=6, n_head=8, n_embd=256), 1, 64)}


def gpt_config(model: str):
    from zerompi.models.gpt import PRESETS, GPTConfig

    shape = MODELS[model][0]
    return PRESETS[shape] if isinstance(shape, str) else GPTConfig(**shape)


# ------------------------------------------------------------------ the ranks
def eth0_tx() -> int:
    """Bytes this network namespace's eth0 sent (/proc/self/net is per namespace)."""
    with open("/proc/self/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == "eth0":
                return int(rest.split()[8])
    return 0


def node_tx(world, node) -> list[int]:
    """Every node's eth0 tx bytes now (each node's first rank reads, every rank gets the list)."""
    quiet_barrier(world)
    mine = eth0_tx() if node.Get_rank() == 0 else None
    return [x for x in world.allgather(mine) if x is not None]


def replay(groups, rows, bufs, n: int) -> None:
    """One step's collectives as the estimator lists them, blocking, in sequence, each on
    the communicator the engine uses for it (zero/groups.py)."""
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


def run_stage(a, stage: int, world, node) -> dict:
    import torch
    from mpi4py import MPI

    import zerompi
    from zerompi.config import load
    from zerompi.estimate import api
    from zerompi.estimate.models import from_shape
    from zerompi.models.gpt import GPT

    rank, n = world.Get_rank(), world.Get_size()
    gcfg, (_, micro, seq) = gpt_config(a.model), MODELS[a.model]
    torch.manual_seed(0)
    engine = zerompi.initialize(GPT(gcfg), {"stage": stage, "precision": "fp32", "optimizer": {"lr": 1e-4},
                                            **MODES[a.mode]})

    def step(k: int) -> None:
        g = torch.Generator().manual_seed(1000 * k + rank)
        x = torch.randint(0, gcfg.vocab_size, (micro, seq), generator=g)
        _, loss = engine(x, torch.roll(x, -1, 1))
        engine.backward(loss)
        engine.step()

    for k in range(a.warmup):
        step(k)
    tx0, times = node_tx(world, node), []
    engine.reset_comm_stats()
    for k in range(a.steps):
        quiet_barrier(world)
        t0 = time.perf_counter()
        step(a.warmup + k)
        times.append(world.allreduce(time.perf_counter() - t0, op=MPI.MAX))
    tx1, step_stats = node_tx(world, node), engine.comm_stats()
    res = {"stage": stage, "mode_ran": engine.groups.mode, "describe": engine.groups.describe(),
           "params": sum(p.numel() for p in engine.module.parameters()), "step_seconds": times,
           "node_tx_per_step": [(b - a_) / a.steps for a_, b in zip(tx0, tx1)]}
    if a.replays and a.mode in REPLAYABLE:
        zc = load({"stage": stage, "precision": "fp32"})  # the logical collectives: the same in both modes
        rows = api.size(from_shape(a.model, gcfg, seq), [n], [stage], zero=zc)["runs"][0]["collectives"]
        big = max(r["elements"] for r in rows if not r["scalars"])
        bufs = {"send": torch.rand(big), "scratch": torch.empty(big), "recv": torch.empty(big // n),
                "full": torch.rand(big)}
        walls = []
        for k in range(a.replays + 1):  # the first is a warm-up
            engine.comm.reset_stats()
            quiet_barrier(world)
            t0 = time.perf_counter()
            replay(engine.groups, rows, bufs, n)
            walls.append(world.allreduce(time.perf_counter() - t0, op=MPI.MAX))
        rep_stats = engine.comm.stats()
        keys = ("calls", "elements")
        res["replay_seconds"] = walls[1:]
        res["replay_matches_step"] = all(
            [step_stats.get(op, {}).get(k) for k in keys] == [rep_stats.get(op, {}).get(k) for k in keys]
            for op in set(step_stats) | set(rep_stats))
    del engine
    return res


def worker(a) -> None:
    import torch
    from mpi4py import MPI

    torch.set_num_threads(1)
    world = MPI.COMM_WORLD
    node = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.Get_rank())
    out = {"stages": []}
    for s in map(int, a.stages.split(",")):
        out["stages"].append(run_stage(a, s, world, node))
    if world.Get_rank() == 0:
        Path(a.out).write_text(json.dumps(out))


# ------------------------------------------------------------------ the driver
def predict(model: str, stage: int, mode: str, nodes: int, ppn: int, rate: float | None, alpha: float) -> dict:
    """The estimator for the run's own mode on NODES x PPN ranks, one link per node."""
    from zerompi.config import load
    from zerompi.estimate import api
    from zerompi.estimate.models import from_shape

    beta = 8 / (rate * 1e6 * PAYLOAD_SHARE) if rate else None
    zc = load({"stage": stage, "precision": "fp32", **MODES[mode]})
    kw = {"alpha": alpha, "beta": beta} if rate else {"link": "ndr-ib"}
    run = api.size(from_shape(model, gpt_config(model), MODELS[model][2]), [nodes * ppn], [stage], zero=zc,
                   ranks_per_node=ppn, nics_per_node=1, modes={}, **kw)["runs"][0]
    d = run["nodes"]
    return {"params": run["params"], "mode": d["mode"], "node_link_bytes": d["node_link_bytes"],
            "cross_bytes_total": d["cross_bytes_total"], "seconds": d["time"]["seconds"] if rate else None}


def compare(run: dict, alpha: float, model: str) -> None:
    """Each stage of a 2+ node run beside its prediction (in place)."""
    for st in run["stages"]:
        if run["nodes"] < 2:
            continue
        p = predict(model, st["stage"], run["mode"], run["nodes"], run["ppn"], run["rate_mbit"], alpha)
        if p["mode"] != st["mode_ran"] or p["params"] != st["params"]:
            raise SystemExit(f"{run['name']} stage {st['stage']}: the engine ran {st['mode_ran']} with "
                             f"{st['params']} parameters, the estimator has {p['mode']}, {p['params']}")
        meas = statistics.mean(st["node_tx_per_step"])
        st.update(predicted=p, bytes_ratio=meas / p["node_link_bytes"] if p["node_link_bytes"] else None)
        st["bytes_ok"] = st["bytes_ratio"] is not None and abs(st["bytes_ratio"] - 1) <= BYTES_TOL
        if "replay_seconds" in st and p["seconds"]:
            st["time_ratio"] = statistics.median(st["replay_seconds"]) / p["seconds"]
            st["time_ok"] = max(st["time_ratio"], 1 / st["time_ratio"]) <= 1 + TIME_TOL


def run_job(net, a, nodes: int, ppn: int, rate, mode: str, work: Path) -> dict:
    out = work / f"job{len(list(work.iterdir()))}.json"
    for node in net.nodes:
        net.shape(node, rate_mbit=rate or 0)
    quiet = wait_quiet(a.max_busy, a.max_wait)
    argv = [Path(__file__).resolve(), "--worker", "--out", out, "--model", a.model, "--stages", a.stages,
            "--mode", mode, "--warmup", a.warmup, "--steps", a.steps, "--replays", a.replays]
    name = f"{nodes} x {ppn}" + (f", {rate:g} Mbit/s" if rate else ", unshaped") + f", {mode}"
    with ForeignCpu() as other:
        job = launch(None, argv, timeout=a.timeout, mpiexec=net.mpiexec_argv(ppn=ppn, nodes=net.nodes[:nodes]))
    if not job.ok:
        raise SystemExit(f"{name}: the job failed ({job.status}): {job.command_line}\n{job.tail()}")
    run = {"name": name, "nodes": nodes, "ppn": ppn, "rate_mbit": rate or None, "mode": mode,
           "wall_s": other.wall, "foreign_cpu_fraction": other.fraction, "quiet_wait": quiet,
           **json.loads(out.read_text())}
    compare(run, a.alpha, a.model)
    for st in run["stages"]:
        print(f"[{name}] stage {st['stage']} ({st['mode_ran']}): step {statistics.median(st['step_seconds']):.3f} s, "
              f"MiB/node/step {[round(x / 2**20, 2) for x in st['node_tx_per_step']]}, bytes/predicted "
              f"{st.get('bytes_ratio') or 0:.3f}, comm time/predicted {st.get('time_ratio') or 0:.2f}", flush=True)
    return run


def drive(a) -> int:
    sys.path.insert(0, str(ROOT / "tests" / "support"))
    from netcluster import NetCluster, available

    ok, why = available()
    if not ok:
        print(f"bench_nodes: {why}", file=sys.stderr)
        return 2
    layouts = [tuple(map(int, x.split("x"))) for x in a.layouts.split(",")]
    rates = [float(r) or None for r in a.rates.split(",")]
    modes = a.modes.split(",")
    unknown = set(modes) - set(MODES)
    if unknown:
        raise SystemExit(f"--modes: unknown {sorted(unknown)} (known: {', '.join(MODES)})")
    plan = [(k, p, r, m) for _ in range(a.repeats) for k, p in layouts
            for r, m in ([(None, "auto")] if k == 1 else [(r, m) for r in rates for m in modes])]
    res = {"benchmark": "bench_nodes", **record(), "args": vars(a), "payload_share": PAYLOAD_SHARE,
           "targets": {"node_bytes": BYTES_TOL, "comm_time": TIME_TOL},
           "link": "veth pair into a Linux bridge, MTU 1500; tc tbf on each node's eth0 (egress), burst max(128 KiB, "
                   "1 ms); MPICH ch4:ucx tcp between nodes, shared memory inside", "runs": []}
    with tempfile.TemporaryDirectory(prefix="bench-nodes-") as work, \
            NetCluster(nodes=max(k for k, _ in layouts), rate_mbit=None) as net:
        for k, p, r, m in plan:
            res["runs"].append(run_job(net, a, k, p, r, m, Path(work)))
            write_json(a.out, res)
    res["loadavg_end"] = os.getloadavg()
    write_json(a.out, res)
    if not a.smoke:
        plot(res, Path(a.out).with_suffix(".png"))
    report(res)
    return 0


def rows(res: dict) -> list[dict]:
    return [dict(st, run=r["name"], mode=r["mode"], nodes=r["nodes"], step_s=statistics.median(st["step_seconds"]))
            for r in res["runs"] for st in r["stages"]]


def report(res: dict) -> None:
    print(f"{'run':36s} {'stage':>5s} {'step s':>7s} {'MiB/node':>9s} {'b ratio':>7s} {'t ratio':>7s}")
    for r in rows(res):
        print(f"{r['run']:36s} {r['stage']:5d} {r['step_s']:7.3f} {max(r['node_tx_per_step']) / 2**20:9.2f} "
              f"{r.get('bytes_ratio') or float('nan'):7.3f} {r.get('time_ratio') or float('nan'):7.2f}")


def plot(res: dict, png: Path) -> None:
    plt = pyplot()
    rs = rows(res)
    names = list(dict.fromkeys(r["run"] for r in rs))
    stages = sorted({r["stage"] for r in rs})
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    w = 0.8 / len(names)
    for i, nm in enumerate(names):
        xs = [s + (i - (len(names) - 1) / 2) * w for s in stages]
        ax1.bar(xs, [statistics.median(r["step_s"] for r in rs if r["run"] == nm and r["stage"] == s) for s in stages],
                w, label=nm)
        pts = [(r["stage"], r["bytes_ratio"]) for r in rs if r["run"] == nm and r.get("bytes_ratio")]
        if pts:
            ax2.plot(*zip(*pts), "o-", label=f"{nm}: bytes/node")
        pts = [(r["stage"], r["time_ratio"]) for r in rs if r["run"] == nm and r.get("time_ratio")]
        if pts:
            ax2.plot(*zip(*pts), "s--", label=f"{nm}: comm time")
    for y, ls in ((1, "-"), (1 + BYTES_TOL, ":"), (1 - BYTES_TOL, ":"), (1 + TIME_TOL, "-."), (1 / (1 + TIME_TOL), "-.")):
        ax2.axhline(y, color="grey", lw=0.8, ls=ls)
    for ax, ylabel, title in ((ax1, "step time (s), median of the slowest rank", "step time"),
                              (ax2, "measured / zerompi.estimate", "measured vs predicted (dotted 10%, dash-dot 30%)")):
        ax.set_xticks(stages)
        ax.set_xlabel("ZeRO stage")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.legend(fontsize=7)
    save_figure(fig, png, f"{machine_title(res['machine'])}; simulated nodes; {res['args']['model']} GPT fp32")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(Path(tempfile.gettempdir()) / "nodes.json"))
    ap.add_argument("--replot", help="redraw the PNG of a results JSON (next to it)")
    ap.add_argument("--smoke", action="store_true", help="one tiny 2 x 2 job (seconds): checks the benchmark")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="flat", help=argparse.SUPPRESS)
    ap.add_argument("--layouts", default="2x2", help="NODESxRANKS_PER_NODE, comma-separated")
    ap.add_argument("--rates", default="100", help="link rates to shape, Mbit/s (0: unshaped)")
    ap.add_argument("--modes", default="flat,auto", help=f"hierarchy modes of the multi-node runs: {', '.join(MODES)}")
    ap.add_argument("--model", default="small", choices=sorted(MODELS))
    ap.add_argument("--stages", default="0,1,2,3")
    ap.add_argument("--repeats", type=int, default=1, help="rounds of the whole plan (step times)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--replays", type=int, default=0)
    ap.add_argument("--alpha", type=float, default=50e-6, help="the link's latency assumed by the prediction, s")
    ap.add_argument("--max-busy", type=float, default=0.15)
    ap.add_argument("--max-wait", type=float, default=300)
    ap.add_argument("--timeout", type=float, default=1200)
    a = ap.parse_args(argv)
    if a.worker:
        worker(a)
        return 0
    if a.replot:
        res = json.loads(Path(a.replot).read_text())
        plot(res, Path(a.replot).with_suffix(".png"))
        report(res)
        return 0
    if a.smoke:
        a.layouts, a.rates, a.modes, a.model, a.stages = "2x2", "0", "two-level", "tiny", "2"
        a.repeats, a.warmup, a.steps, a.replays, a.max_busy, a.timeout = 1, 1, 1, 1, 1.0, 300
    return drive(a)


if __name__ == "__main__":
    sys.exit(main())
