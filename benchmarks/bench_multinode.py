#!/usr/bin/env python
"""2 nodes x 2 ranks against 1 node x 4 ranks, ZeRO stages 0-3, on simulated nodes
(tests/netcluster.py: network namespaces, a bridge, `tc tbf` on each node's link), next
to what `python -m zerompi.estimate --nodes 2` predicts for the same link (issue 25).

    sudo python benchmarks/bench_multinode.py --out benchmarks/results/multinode_cpu.json \
        --png benchmarks/results/multinode_cpu.png

Per configuration one `mpiexec` job of benchmarks/multinode_worker.py runs every stage:
real steps of the `small` GPT (3.26M parameters, fp32, default buckets), whose step time
and bytes that left each node per step (its eth0 counters) are recorded, then a replay
of that step's collectives without compute (exactly the rows the estimator lists, checked
against the engine's own calls and elements), whose wall time is the measured
communication time. Configurations: 2 x 2 on a link shaped to each of --rates (Mbit/s,
each direction of each node), and 1 x 4 on one node (shared memory only).

The estimator gets the link as alpha = --alpha (an assumption: TCP through a veth pair,
negligible next to these ~MB messages) and beta = 1 / payload rate, the payload rate
being the shaped wire rate times TCP's payload share of a full frame (1448 of 1514
bytes at MTU 1500). Targets: bytes a node sends within 10% of the prediction, the
replay's time within 30% either way. Before each job the driver waits (up to
--max-wait) for other processes to leave the 2 cores alone, and records how much of the
machine they used meanwhile. Needs root (network namespaces). `--replot JSON` redraws.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from bench_env import ROOT, machine_info
from calibrate_comm import _children_cpu, _cpu_busy, wait_quiet

sys.path.insert(0, str(ROOT / "tests"))
PAYLOAD_SHARE = 1448 / 1514  # TCP payload per wire byte, full frames, MTU 1500, timestamps on
BYTES_TOL, TIME_TOL = 0.10, 0.30


def run_config(name: str, nodes: int, ppn: int, rate, args, work: Path) -> dict:
    from netcluster import NetCluster

    out = work / (name.replace(" ", "").replace(",", "_").replace("/", "") + ".json")
    with NetCluster(nodes=nodes, rate_mbit=rate) as net:
        quiet = wait_quiet(args.max_busy, args.max_wait)
        cmd = net.mpiexec_argv(ppn=ppn) + [sys.executable, str(Path(__file__).with_name("multinode_worker.py")),
                                           "--out", str(out), "--model", args.model, "--stages", args.stages,
                                           "--steps", str(args.steps), "--replays", str(args.replays)]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "benchmarks")]))
        print(f"[{name}] {' '.join(shlex.quote(c) for c in cmd[-12:])}", flush=True)
        t0, b0, c0 = time.time(), _cpu_busy(), _children_cpu()
        p = subprocess.Popen(cmd, env=env, cwd=ROOT, start_new_session=True)
        try:
            rc = p.wait(timeout=args.timeout)
        except BaseException:
            os.killpg(p.pid, 9)  # the job's own process group
            p.wait()
            raise
        if rc:
            raise SystemExit(f"{name}: worker failed with exit code {rc}")
        wall, busy, own = time.time() - t0, _cpu_busy() - b0, _children_cpu() - c0
        res = json.loads(out.read_text())
        link = {"rate_mbit": rate, "shaping": "tc tbf on each node's eth0 (egress), burst max(128 KiB, 1 ms)",
                "interface": "veth pair into a Linux bridge, MTU 1500"} if rate else None
        res.update(name=name, link=link, wall_s=wall, quiet_wait=quiet,
                   foreign_cpu_fraction=max(0.0, busy - own) / (wall * (os.cpu_count() or 1)))
        print(f"[{name}] {wall:.0f} s; other processes used {100 * res['foreign_cpu_fraction']:.0f}% "
              "of the machine meanwhile", flush=True)
        return res


def predict(args, rate: float) -> dict:
    """`python -m zerompi.estimate --nodes 2` for the shaped link: {stage: internode}."""
    beta = 8 / (rate * 1e6 * PAYLOAD_SHARE)
    cmd = [sys.executable, "-m", "zerompi.estimate", "--model", args.model, "--dp", "4", "--stage", args.stages,
           "--precision", "fp32", "--nodes", "2", "--alpha", repr(args.alpha), "--beta", repr(beta), "--json"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True)
    runs = json.loads(r.stdout)["runs"]
    return {"command": " ".join(shlex.quote(c) for c in cmd[1:]), "alpha": args.alpha, "beta": beta,
            "by_stage": {str(d["stage"]): {"node_bytes": d["internode"]["node_bytes"],
                                           "seconds": d["internode"]["seconds"]} for d in runs}}


def analyse(res: dict) -> list[dict]:
    rows = []
    for cfg in res["configs"]:
        pred = res["predictions"].get(cfg["name"])
        for st in cfg["stages"]:
            row = {"config": cfg["name"], "stage": st["stage"], "step_s": st["step_median_s"],
                   "replay_s": st["replay_median_s"], "node_tx_per_step": st["node_tx_per_step"],
                   "replay_matches_step": st["replay_matches_step"]}
            if pred:
                p = pred["by_stage"][str(st["stage"])]
                meas_b = sum(st["node_tx_per_step"]) / len(st["node_tx_per_step"])
                row.update(pred_node_bytes=p["node_bytes"], pred_s=p["seconds"], meas_node_bytes=meas_b,
                           bytes_ratio=meas_b / p["node_bytes"], time_ratio=st["replay_median_s"] / p["seconds"])
                row["bytes_ok"] = abs(row["bytes_ratio"] - 1) <= BYTES_TOL
                row["time_ok"] = max(row["time_ratio"], 1 / row["time_ratio"]) <= 1 + TIME_TOL
            rows.append(row)
    return rows


def plot(res: dict, png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["analysis"]
    cfgs = [c["name"] for c in res["configs"]]
    stages = sorted({r["stage"] for r in rows})
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    w = 0.8 / len(cfgs)
    for i, c in enumerate(cfgs):
        ys = [next(r["step_s"] for r in rows if r["config"] == c and r["stage"] == s) for s in stages]
        a.bar([s + (i - (len(cfgs) - 1) / 2) * w for s in stages], ys, w, label=c)
    a.set_xticks(stages)
    a.set_xlabel("ZeRO stage")
    a.set_ylabel("step time (s), median")
    a.set_title("step time: 1 node x 4 ranks vs 2 nodes x 2 ranks")
    a.legend(fontsize=8)
    for c in cfgs:
        rs = [r for r in rows if r["config"] == c and "bytes_ratio" in r]
        if rs:
            b.plot([r["stage"] for r in rs], [r["bytes_ratio"] for r in rs], "o-", label=f"{c}: bytes/node")
            b.plot([r["stage"] for r in rs], [r["time_ratio"] for r in rs], "s--", label=f"{c}: comm time")
    limits = ((1, "-"), (1 + BYTES_TOL, ":"), (1 - BYTES_TOL, ":"), (1 + TIME_TOL, "-."), (1 / (1 + TIME_TOL), "-."))
    for y, ls in limits:
        b.axhline(y, color="grey", lw=0.8, ls=ls)
    b.set_xticks(stages)
    b.set_xlabel("ZeRO stage")
    b.set_ylabel("measured / zerompi.estimate")
    b.set_title("measured vs predicted (dotted: 10%, dash-dot: 30%)")
    b.legend(fontsize=7)
    m = res["machine"]
    fig.suptitle(f"{m['cpu_model']}, {m['cores']} cores; simulated nodes (netns + veth + tbf); "
                 f"{res['model']} GPT fp32", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def report(res: dict) -> None:
    print(f"{'config':14s} {'stage':>5s} {'step s':>7s} {'comm s':>7s} {'pred s':>7s} {'t ratio':>7s} "
          f"{'MiB/node':>9s} {'pred':>7s} {'b ratio':>7s}")
    for r in res["analysis"]:
        extra = (f"{r['pred_s']:7.3f} {r['time_ratio']:7.2f} {r['meas_node_bytes'] / 2**20:9.2f} "
                 f"{r['pred_node_bytes'] / 2**20:7.2f} {r['bytes_ratio']:7.3f}") if "pred_s" in r else \
            f"{'':7s} {'':7s} {max(r['node_tx_per_step']) / 2**20:9.2f}"
        print(f"{r['config']:14s} {r['stage']:5d} {r['step_s']:7.3f} {r['replay_s']:7.3f} {extra}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/multinode_cpu.json"))
    ap.add_argument("--png", default=str(ROOT / "benchmarks/results/multinode_cpu.png"))
    ap.add_argument("--replot", help="redraw the PNG of a results JSON")
    ap.add_argument("--rates", default="100,400", help="link rates to shape, Mbit/s")
    ap.add_argument("--model", default="small")
    ap.add_argument("--stages", default="0,1,2,3")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--replays", type=int, default=5)
    ap.add_argument("--alpha", type=float, default=50e-6)
    ap.add_argument("--max-busy", type=float, default=0.15)
    ap.add_argument("--max-wait", type=float, default=300)
    ap.add_argument("--timeout", type=float, default=1200)
    args = ap.parse_args(argv)
    if args.replot:
        res = json.loads(Path(args.replot).read_text())
        plot(res, args.png)
        report(res)
        return
    work = Path(args.out).with_suffix(".parts")
    work.mkdir(parents=True, exist_ok=True)
    rates = [float(x) for x in args.rates.split(",")]
    res = {"date": _dt.datetime.now().isoformat(timespec="seconds"), "model": args.model, "machine": machine_info(),
           "loadavg_start": os.getloadavg(), "targets": {"node_bytes": BYTES_TOL, "comm_time": TIME_TOL},
           "payload_share": PAYLOAD_SHARE, "configs": [], "predictions": {}}
    res["configs"].append(run_config("1 node x 4", 1, 4, None, args, work))
    for rate in rates:
        name = f"2 nodes x 2, {rate:g} Mbit/s"
        res["configs"].append(run_config(name, 2, 2, rate, args, work))
        res["predictions"][name] = predict(args, rate)
    res["analysis"] = analyse(res)
    res["loadavg_end"] = os.getloadavg()
    Path(args.out).write_text(json.dumps(res, indent=1))
    plot(res, args.png)
    report(res)


if __name__ == "__main__":
    main()
