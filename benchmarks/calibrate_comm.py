#!/usr/bin/env python
"""Calibrate the alpha-beta communication model (zerompi/comm/cost_model.py) on this
machine, then check it on real stage-2 steps it was not fitted on.

    python benchmarks/calibrate_comm.py --out benchmarks/results/comm_calibration_vm-epyc_202611.json
    python benchmarks/calibrate_comm.py --replot benchmarks/results/comm_calibration_vm-epyc_202611.json

Per repeat (3) and N (2, 4), two separate N-rank jobs of this file's --worker phases:
  fit    zerompi's MPICommunicator on fp32 buffers of 2^10 .. 2^24 elements (reduce_scatter
         'ordered' and 'native', all_gather), buffers as cold in cache as in a step;
         cost_model.fit gives a link per op and N, and a joint one;
  check  the 17M GPT at stage 2 for bucket sizes 2^16 .. 2^22: the engine's own steps, and a
         replay of one step's collectives without compute (the verdict: prediction within
         30% either way; the in-step number also holds waits for slower peers).
Samples are comm_stats() seconds, mean over ranks, median over batches, then over repeats.
Before each job the driver waits for a quiet machine (--max-busy) and records how much of
it other processes used meanwhile (our ranks spin: any other process changes timings).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import statistics
import time
from pathlib import Path

from harness import RANK_ENV, ForeignCpu, result_path, wait_quiet, write_json
from calibrate_workers import worker
from harness import launch
from zerompi.comm import cost_model as cm

TOL = 0.30


# ================================================================ driver
def run_job(n: int, phase: str, args, work: Path, rep: int = 0) -> dict:
    quiet = wait_quiet(args.max_busy, args.max_wait)
    out = work / f"{phase}-n{n}-r{rep}.json"
    argv = [Path(__file__).resolve(), "--worker", phase, "--out", out] + args.passthrough
    with ForeignCpu() as other:
        job = launch(n, argv, timeout=args.timeout, echo=True)
    if not job.ok:
        raise SystemExit(f"{phase} at N={n} failed ({job.status}): {job.command_line}")
    res = json.loads(out.read_text())
    res["wall_s"] = other.wall
    res["foreign_cpu_fraction"] = other.fraction  # CPU other processes used meanwhile, of the machine
    res["quiet_wait"] = quiet
    print(f"  {phase} N={n}: {other.wall:.0f} s, other processes used "
          f"{100 * res['foreign_cpu_fraction']:.0f}% of the machine meanwhile", flush=True)
    res["command"] = job.command_line
    return res


def fit_rows(samples: list[dict], ops: tuple[str, ...]) -> list[tuple]:
    return [(s["op"].split("/")[0], s["nbytes"], s["n"], s["seconds"]) for s in samples if s["op"] in ops]


def step_rows(chk: dict) -> dict[str, list[tuple]]:
    """One stage-2 fp32 step of the checked engine as cost_model rows, by op."""
    sizes = sorted((int(k), v) for k, v in chk["block_sizes"].items())
    return {"reduce_scatter": [("reduce_scatter", 4 * b, c) for b, c in sizes],
            "all_gather": [("all_gather", 4 * b, c) for b, c in sizes],
            "all_reduce": [("all_reduce", 8 * chk["scalars"], 1, "tree")]}


def within(pred: float, meas: float) -> bool:
    """Within 30% either way: max(pred/meas, meas/pred) <= 1.3."""
    return max(pred / meas, meas / pred) <= 1 + TOL


def analyse(fits: dict, checks: dict) -> dict:
    """Links fitted on the fit jobs only; predictions of the check jobs from them.

    Primary prediction ("per-op"): each op of the step with the link fitted on that op at
    that N (the ordered reduce-scatter's beta includes its local sum; the all-gather's
    does not), the scalar all-reduce with the joint link. Also reported: one joint link
    (reduce-scatter + all-gather samples) for the whole step."""
    links, per_op, fit_err = {}, {}, {}
    used = ("reduce_scatter/ordered", "all_gather")
    for n, f in fits.items():
        links[n] = cm.fit(fit_rows(f["samples"], used), name=f"vm-n{n}")
        per_op[n] = {op: cm.fit(fit_rows(f["samples"], (op,)), name=f"vm-n{n}-{op}")
                     for op in ("reduce_scatter/ordered", "reduce_scatter/native", "all_gather")}
        fit_err[n] = {op: [s["seconds"] / cm.collective_time(s["op"].split("/")[0], s["nbytes"], s["n"],
                                                              per_op[n][op])[0]
                           for s in f["samples"] if s["op"] == op] for op in per_op[n]}
    joint = cm.fit([r for f in fits.values() for r in fit_rows(f["samples"], used)], name="vm-joint")
    table = []
    for n, c in checks.items():
        op_link = {"reduce_scatter": per_op[n]["reduce_scatter/ordered"],
                   "all_gather": per_op[n]["all_gather"], "all_reduce": links[n]}
        for chk in c["checks"]:
            rows = step_rows(chk)
            parts = {op: cm.step_comm_time(r, n, op_link[op]) for op, r in rows.items()}
            pred = sum(p["seconds"] for p in parts.values())
            lat = sum(p["latency_seconds"] for p in parts.values())
            one = cm.step_comm_time([x for r in rows.values() for x in r], n, links[n])
            row = {"n": n, "bucket_log2": chk["bucket_log2"], "blocks": chk["blocks"],
                   "predicted_s": pred, "predicted_latency_fraction": lat / pred,
                   "predicted_by_op": {op: p["seconds"] for op, p in parts.items()},
                   "predicted_one_link_s": one["seconds"]}
            for kind in ("replay", "engine"):
                meas = chk[f"{kind}_median_s"]
                row[f"{kind}_measured_s"] = meas
                row[f"{kind}_measured_by_op"] = {
                    op: statistics.median(d.get(op, 0.0) for d in chk[f"{kind}_by_op"]) for op in rows}
                row[f"{kind}_ratio_measured_over_predicted"] = meas / pred
                row[f"{kind}_within_30pct"] = within(pred, meas)
                row[f"{kind}_one_link_within_30pct"] = within(one["seconds"], meas)
            table.append(row)
    return {"links": {str(n): l.__dict__ for n, l in links.items()}, "joint_link": joint.__dict__,
            "per_op_links": {str(n): {op: l.__dict__ for op, l in v.items()} for n, v in per_op.items()},
            "fit_ratio_measured_over_model": {str(n): v for n, v in fit_err.items()},
            "table": table, "tolerance": TOL, "criterion": "max(pred/meas, meas/pred) <= 1.3",
            "all_replay_within_30pct": all(r["replay_within_30pct"] for r in table),
            "all_engine_within_30pct": all(r["engine_within_30pct"] for r in table)}


def plot(res: dict, png: str) -> None:
    from harness import pyplot

    plt = pyplot()

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.8))
    colors = {"reduce_scatter/ordered": "C0", "reduce_scatter/native": "C2", "all_gather": "C1"}
    for n, f in res["fits"].items():
        mk, ls = ("o", "-") if int(n) == 2 else ("s", "--")
        for op, col in colors.items():
            pts = [s for s in f["samples"] if s["op"] == op]
            a1.scatter([s["nbytes"] for s in pts], [s["seconds"] for s in pts], s=14, marker=mk,
                       facecolors=col if int(n) == 2 else "none", edgecolors=col, label=f"{op}, N={n}")
            link = cm.Link(**res["analysis"]["per_op_links"][str(n)][op])
            xs = [s["nbytes"] for s in pts]
            a1.plot(xs, [cm.collective_time(op.split("/")[0], x, int(n), link)[0] for x in xs], ls, color=col,
                    lw=0.8, label=f"  fit: a={link.alpha * 1e6:.1f} us, 1/b={link.bandwidth / 1e9:.2f} GB/s")
    a1.set(xscale="log", yscale="log", xlabel="full buffer [bytes] (fp32)", ylabel="seconds per call",
           title="fit: zerompi MPICommunicator, comm_stats() seconds")
    a1.legend(fontsize=6)
    tab = res["analysis"]["table"]
    hi = max(max(r["predicted_s"], r["replay_measured_s"], r["engine_measured_s"]) for r in tab) * 1.5
    lo = min(min(r["predicted_s"], r["replay_measured_s"], r["engine_measured_s"]) for r in tab) / 1.5
    a2.fill_between([lo, hi], [lo / (1 + TOL), hi / (1 + TOL)], [lo / (1 - TOL), hi / (1 - TOL)],
                    color="0.9", label="prediction within 30%")
    a2.plot([lo, hi], [lo, hi], "k-", lw=0.6)
    for r in tab:
        col = "C0" if r["n"] == 2 else "C3"
        a2.scatter(r["predicted_s"], r["replay_measured_s"], color=col, marker="o", s=22)
        a2.scatter(r["predicted_s"], r["engine_measured_s"], facecolors="none", edgecolors=col, marker="^", s=22)
        a2.annotate(f"2^{r['bucket_log2']}", (r["predicted_s"], r["replay_measured_s"]), fontsize=6,
                    xytext=(3, -8), textcoords="offset points")
    for p in res.get("per_repeat", []):  # each repeat with its own fit: the spread between runs
        for r in p["table"]:
            a2.scatter(r["predicted_s"], r["replay_measured_s"], color="C0" if r["n"] == 2 else "C3",
                       marker=".", s=8, alpha=0.5)
    for n, col in (("2", "C0"), ("4", "C3")):
        a2.scatter([], [], color=col, marker="o", label=f"N={n} replay (comm only)")
        a2.scatter([], [], facecolors="none", edgecolors=col, marker="^", label=f"N={n} in engine steps")
    a2.scatter([], [], color="0.4", marker=".", s=8, label="replay, single repeats")
    a2.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi), xlabel="predicted [s/step]",
           ylabel="measured comm_stats() [s/step]",
           title=f"check: {res['params']['model']} stage 2 fp32, labels = bucket size")
    a2.legend(fontsize=6, loc="upper left")
    m = res["machine"]
    fig.suptitle(f"alpha-beta calibration on {m['node']} ({m['cpu_model']}, {m['cores']} cores; "
                 f"N=4 oversubscribes) - {' '.join(res['software']['mpi_library'].split())}", fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def merge_fits(runs: list[dict]) -> dict:
    """Per (op, size): the median over repeats of each repeat's median."""
    out = dict(runs[0], samples=[], repeats=len(runs))
    for i, s in enumerate(runs[0]["samples"]):
        secs = [r["samples"][i]["seconds"] for r in runs]
        out["samples"].append(dict(s, seconds=statistics.median(secs), repeat_seconds=secs))
    return out


def merge_checks(runs: list[dict]) -> dict:
    out = dict(runs[0], checks=[], repeats=len(runs))
    for i, c in enumerate(runs[0]["checks"]):
        m = dict(c)
        for kind in ("replay", "engine"):
            m[f"{kind}_repeat_median_s"] = [r["checks"][i][f"{kind}_median_s"] for r in runs]
            m[f"{kind}_median_s"] = statistics.median(m[f"{kind}_repeat_median_s"])
            m[f"{kind}_by_op"] = [d for r in runs for d in r["checks"][i][f"{kind}_by_op"]]
        out["checks"].append(m)
    return out


def driver(args) -> None:
    work = Path(args.work_dir or "/tmp/calibrate_comm")
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    load0 = os.getloadavg()
    fits: dict[int, list] = {n: [] for n in args.nranks}
    checks: dict[int, list] = {n: [] for n in args.nranks}
    # Repeats interleave fit and check jobs in time, so a drift in the machine's state
    # (other work, memory placement) reaches both; every job is its own mpiexec.
    for rep in range(args.repeats):
        for n in args.nranks:  # separate jobs: the check never sees the fit's samples
            fits[n].append(run_job(n, "fit", args, work, rep))
            checks[n].append(run_job(n, "check", args, work, rep))
    first = fits[args.nranks[0]][0]
    merged_f = {n: merge_fits(v) for n, v in fits.items()}
    merged_c = {n: merge_checks(v) for n, v in checks.items()}
    per_repeat = []
    for rep in range(args.repeats):  # each repeat on its own: the spread between runs
        a = analyse({n: fits[n][rep] for n in args.nranks}, {n: checks[n][rep] for n in args.nranks})
        per_repeat.append({"links": a["links"], "per_op_links": a["per_op_links"],
                           "table": [{k: r[k] for k in ("n", "bucket_log2", "predicted_s", "replay_measured_s",
                                                         "replay_ratio_measured_over_predicted",
                                                         "replay_within_30pct", "engine_measured_s",
                                                         "engine_ratio_measured_over_predicted",
                                                         "engine_within_30pct")} for r in a["table"]]})
    res = {"machine": first["machine"], "software": first["software"],
           "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
           "params": {k: v for k, v in vars(args).items() if k not in ("passthrough",)},
           "env": RANK_ENV, "loadavg_start": load0, "loadavg_end": os.getloadavg(),
           "wall_s": time.time() - t0,
           "jobs": [{k: j[k] for k in ("phase", "n", "wall_s", "foreign_cpu_fraction", "quiet_wait", "command")}
                    for n in args.nranks for j in fits[n] + checks[n]],
           "fits": {str(n): f for n, f in merged_f.items()},
           "checks": {str(n): c for n, c in merged_c.items()},
           "analysis": analyse(merged_f, merged_c), "per_repeat": per_repeat,
           "raw": {"fits": {str(n): v for n, v in fits.items()}, "checks": {str(n): v for n, v in checks.items()}}}
    write_json(args.out, res)
    report(res)
    plot(res, Path(args.out).with_suffix(".png"))


def report(res: dict) -> None:
    an = res["analysis"]
    for n, ops in an["per_op_links"].items():
        for op, l in list(ops.items()) + [("joint (rs+ag)", an["links"][n])]:
            gbs = f"{1e-9 / l['beta']:.2f} GB/s" if l["beta"] > 0 else "no bandwidth term fitted"
            print(f"fit N={n} {op:24s}: alpha = {l['alpha'] * 1e6:7.2f} us, beta = {l['beta'] * 1e9:.4f} ns/B ({gbs})")
    print(f"{'N':>2} {'bucket':>6} {'blocks':>6} {'pred ms':>8} {'lat%':>5} {'replay ms':>9} {'ratio':>6} "
          f"{'ok':>3} {'engine ms':>9} {'ratio':>6} {'ok':>3}")
    for r in an["table"]:
        print(f"{r['n']:>2} {'2^' + str(r['bucket_log2']):>6} {r['blocks']:>6} {r['predicted_s'] * 1e3:8.1f} "
              f"{100 * r['predicted_latency_fraction']:5.1f} {r['replay_measured_s'] * 1e3:9.1f} "
              f"{r['replay_ratio_measured_over_predicted']:6.2f} {'yes' if r['replay_within_30pct'] else 'NO':>3} "
              f"{r['engine_measured_s'] * 1e3:9.1f} {r['engine_ratio_measured_over_predicted']:6.2f} "
              f"{'yes' if r['engine_within_30pct'] else 'NO':>3}")
    if res.get("per_repeat"):
        print("replay measured / predicted in each repeat alone (its own fit):")
        for i, row in enumerate(an["table"]):
            rr = [p["table"][i]["replay_ratio_measured_over_predicted"] for p in res["per_repeat"]]
            print(f"  N={row['n']} 2^{row['bucket_log2']}: " + ", ".join(f"{x:.2f}" for x in rr))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", choices=["fit", "check"], help="(internal) run one phase on the MPI ranks")
    ap.add_argument("--nranks", nargs="+", type=int, default=[2, 4])
    ap.add_argument("--repeats", type=int, default=3, help="fit + check jobs per N, interleaved")
    ap.add_argument("--min-log2", type=int, default=10, help="fit: smallest buffer, log2 elements")
    ap.add_argument("--max-log2", type=int, default=24, help="fit: largest buffer, log2 elements")
    ap.add_argument("--batches", type=int, default=7, help="fit: batches per point (median)")
    ap.add_argument("--seconds-per-point", type=float, default=0.35, help="fit: time per op and size")
    ap.add_argument("--buckets", nargs="+", type=int, default=[16, 18, 20, 22], help="check: log2 bucket sizes")
    ap.add_argument("--model", default="gpt-20m", help="check: a zerompi.models.gpt preset")
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--replays", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per mpiexec")
    ap.add_argument("--max-busy", type=float, default=0.15,
                    help="before each job wait until other processes use less than this fraction "
                         "of the machine (1: do not wait)")
    ap.add_argument("--max-wait", type=float, default=600.0, help="longest such wait, s")
    ap.add_argument("--work-dir", default=None)
    ap.add_argument("--out", default=str(result_path("comm_calibration")), help="JSON (its PNG beside it)")
    ap.add_argument("--replot", default=None, help="redraw the PNG (and the table) from a JSON")
    args = ap.parse_args(argv)
    if args.replot:
        res = json.loads(Path(args.replot).read_text())
        report(res)
        plot(res, Path(args.replot).with_suffix(".png"))
    elif args.worker:
        worker(args)
    else:
        keys = ("min_log2", "max_log2", "batches", "seconds_per_point", "model", "micro_batch",
                "seq_len", "warmup", "steps", "replays")
        args.passthrough = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in keys]
        args.passthrough += ["--buckets"] + [str(b) for b in args.buckets]
        driver(args)


if __name__ == "__main__":
    main()
