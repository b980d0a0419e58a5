#!/usr/bin/env python
"""2 nodes x 2 ranks against 1 node x 4 ranks, ZeRO stages 0-3, on simulated nodes
(tests/support/netcluster.py: network namespaces, a bridge, `tc tbf` on each node's link), next
to what `python -m zerompi.estimate --ranks-per-node 2 --nics-per-node 1` predicts for
the same link and the mode each run ran (zerompi/estimate/hierarchy.py; issues 25, 26).

    sudo python benchmarks/bench_multinode.py --out benchmarks/results/multinode_cpu.json \
        --png benchmarks/results/multinode_cpu.png
    sudo python benchmarks/bench_multinode.py --add-to benchmarks/results/multinode_cpu.json --modes auto
    python benchmarks/bench_multinode.py --repredict benchmarks/results/multinode_cpu.json

Per configuration one `mpiexec` job of benchmarks/multinode_worker.py runs every stage:
real steps of the `small` GPT (3.26M parameters, fp32, default buckets), whose step time
and bytes that left each node per step (its eth0 counters) are recorded, then a replay
of that step's collectives without compute (exactly the rows the estimator lists, on the
engine's own communicators, checked against the engine's own calls and elements), whose
wall time is the measured communication time. Configurations: 1 x 4 on one node (shared
memory only), and 2 x 2 on a link shaped to each of --rates (Mbit/s, each direction of
each node) once per zero.comm.hierarchical of --modes: "off" (flat collectives) and
"auto" (the default: two-level across these nodes). Each 2 x 2 run is compared with
the prediction for the mode the engine reports it ran.

The estimator gets the link as one per node (--nics-per-node 1: the node's ranks share
its veth), alpha = --alpha (an assumption: TCP through a veth pair, negligible next to
these ~MB messages) and beta = 1 / payload rate, the payload rate being the shaped wire
rate times TCP's payload share of a full frame (1448 of 1514 bytes at MTU 1500).
Targets: bytes a node sends within 10% of the prediction, the replay's time within 30%
either way. Before each job the driver waits (up to --max-wait) for other processes to
leave the 2 cores alone, and records how much of the machine they used meanwhile. Needs
root (network namespaces). `--replot JSON` redraws; `--repredict JSON` recomputes the
predictions of a results file from its stored run parameters; `--add-to JSON` runs the
configurations it lacks and adds them.
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

sys.path.insert(0, str(ROOT / "tests" / "support"))
PAYLOAD_SHARE = 1448 / 1514  # TCP payload per wire byte, full frames, MTU 1500, timestamps on
BYTES_TOL, TIME_TOL = 0.10, 0.30


def run_config(name: str, nodes: int, ppn: int, rate, hierarchical: str, args, work: Path) -> dict:
    from netcluster import NetCluster

    out = work / (name.replace(" ", "").replace(",", "_").replace("/", "") + ".json")
    with NetCluster(nodes=nodes, rate_mbit=rate) as net:
        quiet = wait_quiet(args.max_busy, args.max_wait)
        cmd = net.mpiexec_argv(ppn=ppn) + [sys.executable, str(Path(__file__).with_name("multinode_worker.py")),
                                           "--out", str(out), "--model", args.model, "--stages", args.stages,
                                           "--steps", str(args.steps), "--replays", str(args.replays),
                                           "--hierarchical", hierarchical]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "benchmarks")]))
        print(f"[{name}] {' '.join(shlex.quote(c) for c in cmd[-14:])}", flush=True)
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
        res.update(name=name, link=link, hierarchical=hierarchical, wall_s=wall, quiet_wait=quiet,
                   foreign_cpu_fraction=max(0.0, busy - own) / (wall * (os.cpu_count() or 1)))
        print(f"[{name}] {wall:.0f} s; other processes used {100 * res['foreign_cpu_fraction']:.0f}% "
              "of the machine meanwhile", flush=True)
        return res


def predict(model: str, stages: str, rate: float, hierarchical: str, alpha: float,
            payload_share: float = PAYLOAD_SHARE) -> dict:
    """`python -m zerompi.estimate --ranks-per-node 2 --nics-per-node 1` for the shaped
    link and the run's zero.comm.hierarchical: {stage: the run's own mode across nodes}."""
    beta = 8 / (rate * 1e6 * payload_share)
    cmd = [sys.executable, "-m", "zerompi.estimate", "--model", model, "--dp", "4", "--stage", stages,
           "--precision", "fp32", "--ranks-per-node", "2", "--nics-per-node", "1", "--hierarchical", hierarchical,
           "--alpha", repr(alpha), "--beta", repr(beta), "--json"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True)
    runs = json.loads(r.stdout)["runs"]
    return {"command": " ".join(shlex.quote(c) for c in cmd[1:]), "alpha": alpha, "beta": beta,
            "by_stage": {str(d["stage"]): {"mode": d["nodes"]["mode"], "node_bytes": d["nodes"]["node_link_bytes"],
                                           "seconds": d["nodes"]["time"]["seconds"]} for d in runs}}


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
                row.update(mode=st.get("mode", "flat"), pred_mode=p["mode"], pred_node_bytes=p["node_bytes"],
                           pred_s=p["seconds"], meas_node_bytes=meas_b,
                           bytes_ratio=meas_b / p["node_bytes"], time_ratio=st["replay_median_s"] / p["seconds"])
                if row["mode"] != row["pred_mode"]:
                    raise SystemExit(f"{cfg['name']} stage {st['stage']}: the engine ran {row['mode']}, the "
                                     f"prediction is for {row['pred_mode']}")
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
    a.set_ylim(0, 1.6 * max(r["step_s"] for r in rows))  # room for the legend above the bars
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
    print(f"{'config':40s} {'stage':>5s} {'step s':>7s} {'comm s':>7s} {'pred s':>7s} {'t ratio':>7s} "
          f"{'MiB/node':>9s} {'pred':>7s} {'b ratio':>7s}")
    for r in res["analysis"]:
        extra = (f"{r['pred_s']:7.3f} {r['time_ratio']:7.2f} {r['meas_node_bytes'] / 2**20:9.2f} "
                 f"{r['pred_node_bytes'] / 2**20:7.2f} {r['bytes_ratio']:7.3f}") if "pred_s" in r else \
            f"{'':7s} {'':7s} {max(r['node_tx_per_step']) / 2**20:9.2f}"
        print(f"{r['config']:40s} {r['stage']:5d} {r['step_s']:7.3f} {r['replay_s']:7.3f} {extra}")


CONFIG_NOTE = ("The configurations measured on 2026-11-26 ran on the engine of issue 25 (91867ad), which "
               "had only flat collectives: what zero.comm.hierarchical = off runs now. --repredict marked them "
               "hierarchical 'off' (mode 'flat'; the 2 x 2 names gained ', hierarchical off') and compares them "
               "with that mode's prediction.")


def repredict(res: dict, note: str) -> dict:
    """The predictions of a results file again, from its stored run parameters (model,
    stages, link rate, alpha, payload share, each run's comm.hierarchical); measurements
    untouched."""
    notes = res.setdefault("notes", [])
    for cfg in res["configs"]:
        if "hierarchical" not in cfg:
            cfg["hierarchical"] = "off"
            for st in cfg["stages"]:
                st.setdefault("mode", "flat")
            if cfg["link"]:  # named as the driver names its 2 x 2 runs now
                res["predictions"].pop(cfg["name"], None)
                cfg["name"] += ", hierarchical off"
            if CONFIG_NOTE not in notes:
                notes.append(CONFIG_NOTE)
        if cfg["link"]:
            old = res["predictions"].get(cfg["name"], {})
            stages = ",".join(str(st["stage"]) for st in cfg["stages"])
            res["predictions"][cfg["name"]] = predict(res["model"], stages, cfg["link"]["rate_mbit"],
                                                      cfg["hierarchical"], old.get("alpha", 50e-6),
                                                      res.get("payload_share", PAYLOAD_SHARE))
    res["analysis"] = analyse(res)
    notes.append(note)
    return res


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/multinode_cpu.json"))
    ap.add_argument("--png", default=str(ROOT / "benchmarks/results/multinode_cpu.png"))
    ap.add_argument("--replot", help="redraw the PNG of a results JSON")
    ap.add_argument("--repredict", help="recompute a results JSON's predictions (and analysis, plot) in place")
    ap.add_argument("--add-to", help="run only the configurations this results JSON lacks, and add them")
    ap.add_argument("--note", default="", help="with --repredict: why (appended to the JSON's notes)")
    ap.add_argument("--rates", default="100,400", help="link rates to shape, Mbit/s")
    ap.add_argument("--modes", default="off,auto", help="zero.comm.hierarchical of the 2 x 2 runs")
    ap.add_argument("--model", default="small")
    ap.add_argument("--stages", default="0,1,2,3")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--replays", type=int, default=5)
    ap.add_argument("--alpha", type=float, default=50e-6)
    ap.add_argument("--max-busy", type=float, default=0.15)
    ap.add_argument("--max-wait", type=float, default=300)
    ap.add_argument("--timeout", type=float, default=1200)
    args = ap.parse_args(argv)
    if args.replot or args.repredict:
        path = args.replot or args.repredict
        res = json.loads(Path(path).read_text())
        if args.repredict:
            res = repredict(res, f"{_dt.date.today()}: predictions recomputed by --repredict. {args.note}".strip())
            Path(path).write_text(json.dumps(res, indent=1))
        plot(res, args.png)
        report(res)
        return
    work = Path(args.out).with_suffix(".parts")
    work.mkdir(parents=True, exist_ok=True)
    rates = [float(x) for x in args.rates.split(",")]
    if args.add_to:
        res = json.loads(Path(args.add_to).read_text())
        args.out = args.add_to
    else:
        res = {"date": _dt.datetime.now().isoformat(timespec="seconds"), "model": args.model,
               "machine": machine_info(), "loadavg_start": os.getloadavg(),
               "targets": {"node_bytes": BYTES_TOL, "comm_time": TIME_TOL}, "payload_share": PAYLOAD_SHARE,
               "configs": [], "predictions": {}}
    have = {c["name"] for c in res["configs"]}
    plan = [("1 node x 4", 1, 4, None, "auto")] + [
        (f"2 nodes x 2, {rate:g} Mbit/s, hierarchical {mode}", 2, 2, rate, mode)
        for rate in rates for mode in args.modes.split(",")]
    for name, nodes, ppn, rate, mode in plan:
        if name in have:
            continue
        res["configs"].append(run_config(name, nodes, ppn, rate, mode, args, work))
        if rate:
            res["predictions"][name] = predict(args.model, args.stages, rate, mode, args.alpha)
        if args.add_to:
            c = res["configs"][-1]
            res.setdefault("notes", []).append(
                f"{_dt.date.today()}: '{name}' added by --add-to; other processes used "
                f"{100 * c['foreign_cpu_fraction']:.0f}% of the machine meanwhile (load average "
                f"{c['loadavg_end'][0]:.1f} at its end).")
    res["analysis"] = analyse(res)
    if not args.add_to:
        res["loadavg_end"] = os.getloadavg()
    Path(args.out).write_text(json.dumps(res, indent=1))
    plot(res, args.png)
    report(res)


if __name__ == "__main__":
    main()
