#!/usr/bin/env python
"""Compare two zerompi checkouts (BEFORE and AFTER a change) for step time and peak RSS.

    python benchmarks/compare_commits.py --before /tmp/zerompi-before --after . \
        --out benchmarks/results/compare_commits_vm-epyc_202611.json       (its PNG beside it)
    python benchmarks/compare_commits.py --replot benchmarks/results/compare_commits_vm-epyc_202611.json

Every run is one job of bench_dp.py's per-rank worker (system zerompi-<stage>, fp32), this
checkout's, started through this file's --worker mode, which imports zerompi from the side's
root first and fails if any zerompi module any rank loaded came from elsewhere. Per
configuration (model x N x stage) the runs alternate sides and the order flips every repeat
and configuration (ABBA, BAAB, ...), so a drift of the machine's load cancels out. Results:
each side's median step time over its timed steps, the after/before ratio and the ratios of
every pair of repeats, CPU seconds per step, peak RSS per rank, and checks that both sides
computed the same losses, memory_report and communication volume.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
GiB = 1 << 30
# Shapes that are not zerompi.models.gpt presets (GPTConfig keyword arguments), added to
# PRESETS in this script's processes only, so both sides build the same model.
# "gpt-135m": byte-level, GPT-2-small width (768, 12 heads) and 19 blocks: 135,654,144 params.
# "gpt-17m": gpt-20m's depth (6) at width 480 (8 heads): 16,872,960 params.
EXTRA_SHAPES = {
    "gpt-135m": dict(vocab_size=256, block_size=1024, n_layer=19, n_head=12, n_embd=768),
    "gpt-17m": dict(vocab_size=256, block_size=256, n_layer=6, n_head=8, n_embd=480),
}
SHAPES = {"gpt-135m": (1, 256), "gpt-17m": (4, 256)}  # per-rank micro-batch, like gpt-200m / gpt-20m


def add_shapes() -> None:
    from zerompi.models.gpt import PRESETS, GPTConfig

    for name, kw in EXTRA_SHAPES.items():
        PRESETS[name] = GPTConfig(**kw)


def worker(root: str, argv: list[str]) -> None:
    """On every rank: zerompi from `root` (before harness puts this checkout on sys.path),
    then bench_dp's worker; rank 0 adds where zerompi came from to the run's JSON."""
    root = os.path.realpath(root)
    sys.path.insert(0, root)
    import zerompi

    add_shapes()
    import bench_dp
    from mpi4py import MPI

    bench_dp.main(argv)
    files = {os.path.realpath(m.__file__) for n, m in list(sys.modules.items())
             if n.split(".")[0] == "zerompi" and getattr(m, "__file__", None)}
    foreign = sorted(set(MPI.COMM_WORLD.allreduce([f for f in files if not f.startswith(root + os.sep)])))
    if MPI.COMM_WORLD.Get_rank() == 0:
        out = Path(argv[argv.index("--out") + 1])
        res = json.loads(out.read_text())
        res.update(zerompi_file=os.path.realpath(zerompi.__file__), zerompi_foreign_modules=foreign)
        out.write_text(json.dumps(res, indent=1))
    if foreign:
        raise SystemExit(f"[compare] zerompi modules from outside {root}: {foreign}")


def tree_sha256(directory: Path) -> str:
    """Every zerompi/**/*.py, path and content: identifies uncommitted code too."""
    h = hashlib.sha256()
    for f in sorted(p for p in directory.rglob("*.py") if "__pycache__" not in p.parts):
        h.update(str(f.relative_to(directory)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def side_info(root: str) -> dict:
    def git(*a):
        r = subprocess.run(["git", "--no-optional-locks", "-C", root, *a], capture_output=True, text=True)
        return r.stdout.rstrip() if r.returncode == 0 else None
    status = git("status", "--porcelain")
    return {"path": root, "git_commit": git("rev-parse", "HEAD"), "git_subject": git("log", "-1", "--format=%s"),
            "git_dirty_files": status.splitlines() if status else [],
            "zerompi_py_sha256": tree_sha256(Path(root) / "zerompi")}


# ------------------------------------------------------------------ the results
def median(xs):
    return statistics.median(xs) if xs else None


def ratio(a, b):
    return a / b if a is not None and b else None


def volume(comm_stats) -> dict | None:
    """comm_stats() without its seconds: what was sent, not how fast."""
    if not isinstance(comm_stats, dict):
        return None
    return {k: {kk: vv for kk, vv in v.items() if kk != "seconds"} if isinstance(v, dict) else v
            for k, v in comm_stats.items()}


def summarize(cfg: dict, runs: list[dict], warmup: int) -> dict:
    out, per = {k: cfg[k] for k in ("model", "n", "stage")}, {}
    for side in ("before", "after"):
        rs = [r for r in runs if r["side"] == side]
        cpu = [statistics.mean(rk["step_cpu_s"][i] for rk in r["ranks"])
               for r in rs for i in range(warmup, len(r["step_time_s_per_step"]))]
        per[side] = {"runs": len(rs),
                     "step_time_s_median": median([t for r in rs for t in r["step_time_s_per_step"][warmup:]]),
                     "step_time_s_per_repeat_median": [r["step_time_s_median"] for r in rs],
                     "step_cpu_s_median": median(cpu),
                     "peak_rss_steps_bytes_max_rank_median": median(
                         [p for r in rs if (p := r.get("peak_rss_steps_bytes_max_rank"))]),
                     "peak_rss_process_bytes_max_rank_median": median(
                         [r["peak_rss_process_bytes_max_rank"] for r in rs]),
                     "loadavg_start": [r.get("loadavg_start") for r in rs]}
    out.update(per)
    b, a = per["before"], per["after"]
    for key, field in (("step_time", "step_time_s_median"), ("step_cpu", "step_cpu_s_median"),
                       ("peak_rss_steps", "peak_rss_steps_bytes_max_rank_median"),
                       ("peak_rss_process", "peak_rss_process_bytes_max_rank_median")):
        out[f"ratio_{key}"] = ratio(a[field], b[field])
    # every (after, before) pair of repeat medians: a ratio inside their spread is noise
    out["ratio_step_time_pairs"] = [x / y for x in a["step_time_s_per_repeat_median"]
                                    for y in b["step_time_s_per_repeat_median"] if y]
    rb, ra = ([r for r in runs if r["side"] == s] for s in ("before", "after"))
    if rb and ra:  # the same computation on both sides (fp32, same seed, same batches)?
        lb, la = rb[0]["loss_per_step"], ra[0]["loss_per_step"]
        out["loss_max_abs_diff_after_vs_before"] = (max(abs(x - y) for x, y in zip(la, lb))
                                                    if len(la) == len(lb) else None)
        out["memory_report_equal"] = ([rk.get("memory_report") for rk in rb[0]["ranks"]]
                                      == [rk.get("memory_report") for rk in ra[0]["ranks"]])
        out["comm_volume_equal"] = ([volume(rk.get("comm_stats")) for rk in rb[0]["ranks"]]
                                    == [volume(rk.get("comm_stats")) for rk in ra[0]["ranks"]])
    return out


def overall(configs: list[dict]) -> dict:
    def gm(key):
        v = [c[key] for c in configs if c.get(key)]
        return math.exp(statistics.mean(math.log(x) for x in v)) if v else None
    worst = max((c for c in configs if c.get("ratio_step_time")), key=lambda c: c["ratio_step_time"], default=None)
    return {"configs": len(configs), "geomean_ratio_step_time": gm("ratio_step_time"),
            "geomean_ratio_step_cpu": gm("ratio_step_cpu"), "geomean_ratio_peak_rss_steps": gm("ratio_peak_rss_steps"),
            "max_ratio_step_time": worst and worst["ratio_step_time"],
            "max_ratio_step_time_config": worst and f"{worst['model']} N={worst['n']} stage {worst['stage']}",
            "all_losses_equal": all(c.get("loss_max_abs_diff_after_vs_before") == 0.0 for c in configs),
            "all_memory_reports_equal": all(c.get("memory_report_equal") for c in configs),
            "all_comm_volumes_equal": all(c.get("comm_volume_equal") for c in configs)}


def print_table(doc: dict) -> None:
    f = lambda v, d=3: "-" if v is None else f"{v:.{d}f}"  # noqa: E731
    print(f"{'model':9s} {'N':>2s} {'st':>2s} | {'before s':>8s} {'after s':>8s} {'ratio':>6s} {'pairs':>13s} "
          f"{'cpu r':>6s} | {'RSS r':>6s} | loss= mem= comm=")
    for c in doc["configs"]:
        pr = c["ratio_step_time_pairs"]
        d = c.get("loss_max_abs_diff_after_vs_before")
        print(f"{c['model']:9s} {c['n']:2d} {c['stage']:2d} | {f(c['before']['step_time_s_median']):>8s} "
              f"{f(c['after']['step_time_s_median']):>8s} {f(c['ratio_step_time']):>6s} "
              f"{(f'{min(pr):.3f}-{max(pr):.3f}' if pr else '-'):>13s} {f(c['ratio_step_cpu']):>6s} | "
              f"{f(c['ratio_peak_rss_steps']):>6s} | {str(None if d is None else d == 0.0):>5s} "
              f"{str(c.get('memory_report_equal')):>4s} {str(c.get('comm_volume_equal')):>5s}")


def plot(doc: dict, png) -> None:
    """After/before ratios per configuration: step time (whiskers: every repeat pair; open
    diamond: CPU seconds per step) and peak RSS per rank during the steps."""
    from harness import pyplot, save_figure

    cs = [c for c in doc["configs"] if c.get("ratio_step_time")]
    if not cs:
        print("[compare] nothing to plot", flush=True)
        return
    plt = pyplot()
    fig, (ax_t, ax_m) = plt.subplots(2, 1, figsize=(max(9.0, 0.9 * len(cs) + 3), 8), sharex=True)
    for x, c in enumerate(cs):
        col = {1: "#6baed6", 2: "#2171b5", 3: "#08306b"}.get(c["stage"], "grey")
        r, pr = c["ratio_step_time"], c["ratio_step_time_pairs"] or [c["ratio_step_time"]]
        ax_t.errorbar(x, r, yerr=[[max(0.0, r - min(pr))], [max(0.0, max(pr) - r)]], fmt="o", color=col, capsize=4)
        if c.get("ratio_step_cpu"):
            ax_t.plot(x + 0.2, c["ratio_step_cpu"], "D", mfc="white", mec=col, ms=5)
        if c.get("ratio_peak_rss_steps"):
            ax_m.plot(x, c["ratio_peak_rss_steps"], "o", color=col)
    for ax, label in ((ax_t, "median step time"), (ax_m, "peak RSS per rank (steps)")):
        ax.axhline(1.0, color="black", lw=1.0)
        ax.grid(axis="y", alpha=0.3)
        ax.set_ylabel(f"AFTER / BEFORE, {label}")
    ax_m.set_xticks(range(len(cs)), [f"{c['model']}\nN={c['n']} s{c['stage']}" for c in cs], fontsize=8)
    sd, m = doc.get("sides", {}), doc.get("machine", {})
    com = lambda s: (sd.get(s, {}).get("git_commit") or "?")[:8] + ("+dirty" if sd.get(s, {}).get("git_dirty_files") else "")  # noqa: E731,E501
    save_figure(fig, png, f"zerompi AFTER ({com('after')}) / BEFORE ({com('before')}), fp32 AdamW on CPU; "
                          f"{m.get('cpu_model', '?')}, {m.get('cores', '?')} cores")


# ------------------------------------------------------------------ the driver
def driver(args) -> int:
    import mpi4py

    mpi4py.rc.initialize = mpi4py.rc.finalize = False  # this process only reads versions: no MPI_Init
    from harness import DEFAULT_SHAPES, launch, machine_info, software_info, wait_quiet, write_json
    from zerompi.models.gpt import PRESETS, count_params

    add_shapes()
    roots = {s: os.path.realpath(getattr(args, s)) for s in ("before", "after")}
    for p in roots.values():
        if not (Path(p) / "zerompi" / "__init__.py").exists():
            sys.exit(f"{p}: no zerompi/__init__.py there")
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="compare_commits_"))
    work.mkdir(parents=True, exist_ok=True)
    configs = []
    for m in args.models:
        if m not in PRESETS:
            sys.exit(f"--models {m}: not a zerompi.models.gpt preset nor one of {list(EXTRA_SHAPES)}")
        bsz, seq = SHAPES.get(m) or DEFAULT_SHAPES.get(m, (1, 256))
        steps = args.steps_large if count_params(PRESETS[m]) >= 100_000_000 else args.steps
        configs += [{"model": m, "n": n, "stage": st, "micro_batch": bsz, "seq_len": seq, "steps": steps}
                    for n in args.nranks for st in args.stages]
    # ABBA per configuration; the first side flips from one configuration to the next
    plan = [(ci, rep, side) for ci in range(len(configs)) for rep in range(args.repeats)
            for side in (("before", "after") if (ci + rep) % 2 == 0 else ("after", "before"))]
    sw = {k: v for k, v in software_info().items() if k not in ("zerompi", "git_commit", "git_dirty")}
    doc = {"benchmark": "compare_commits: zerompi BEFORE vs AFTER, data parallel on CPU, fp32",
           "machine_label": args.machine_label, "machine": machine_info(), "software": sw,
           "sides": {s: side_info(r) for s, r in roots.items()}, "parameters": vars(args),
           "loadavg_at_start": os.getloadavg(), "configs": [], "summary": {}, "runs": [], "failed": []}
    t_all = time.monotonic()
    try:
        for i, (ci, rep, side) in enumerate(plan):
            cfg = configs[ci]
            tag = f"{cfg['model']}__n{cfg['n']}__s{cfg['stage']}__r{rep}__{side}"
            rfile = work / f"{tag}.json"
            argv = [HERE / "compare_commits.py", "--worker", roots[side], "--", "--worker", "--system",
                    f"zerompi-{cfg['stage']}", "--model", cfg["model"], "--micro-batch", cfg["micro_batch"],
                    "--seq-len", cfg["seq_len"], "--warmup", args.warmup, "--steps", cfg["steps"],
                    "--seed", args.seed, "--out", rfile]
            wait_quiet(args.wait_quiet, args.wait_quiet_max)  # other work on the cores skews timings
            job = launch(cfg["n"], [str(a) for a in argv], timeout=args.run_timeout, root=roots[side],
                         log=work / f"{tag}.log")
            label = f"({i + 1}/{len(plan)}) {cfg['model']} N={cfg['n']} stage {cfg['stage']} rep {rep} {side:6s}"
            if job.ok and rfile.exists():
                run = {**json.loads(rfile.read_text()), "side": side, "repeat": rep, "wall_s": job.elapsed_s,
                       "zerompi_py_sha256": tree_sha256(Path(roots[side]) / "zerompi")}
                doc["runs"].append(run)
                print(f"[compare] {label}: median step {run['step_time_s_median']:.3f}s", flush=True)
            else:
                doc["failed"].append({**cfg, "side": side, "repeat": rep, "status": job.status,
                                      "log_tail": job.tail()})
                print(f"[compare] {label} FAILED ({job.status}):\n{job.tail()}", flush=True)
            doc["configs"] = [summarize(c, [r for r in doc["runs"] if (r["model"], r["n"], r["stage"])
                                            == (c["model"], c["n"], c["stage"])], args.warmup) for c in configs]
            doc["summary"] = overall([c for c in doc["configs"] if c["before"]["runs"] and c["after"]["runs"]])
            doc["total_wall_s"] = time.monotonic() - t_all
            write_json(args.out, doc)  # after every run: an interrupted sweep keeps its results
    except KeyboardInterrupt:  # launch killed the running job
        print("[compare] interrupted; kept what finished", flush=True)
    print_table(doc)
    plot(doc, Path(args.out).with_suffix(".png"))
    print(f"[compare] wrote {args.out} and its PNG ({len(doc['runs'])} runs, {len(doc['failed'])} failed)")
    return 1 if doc["failed"] else 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:  # compare_commits.py --worker ROOT -- BENCH_DP_ARGS
        worker(argv[1], argv[argv.index("--") + 1:])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", default="/tmp/zerompi-before", help="checkout BEFORE the change")
    ap.add_argument("--after", default=str(HERE.parent), help="checkout AFTER (default: this one)")
    ap.add_argument("--models", nargs="+", default=["gpt-17m", "gpt-135m"],
                    help=f"zerompi.models.gpt presets or {list(EXTRA_SHAPES)}")
    ap.add_argument("--stages", nargs="+", type=int, default=[1, 2, 3], choices=[0, 1, 2, 3])
    ap.add_argument("--nranks", nargs="+", type=int, default=[2, 4])
    ap.add_argument("--repeats", type=int, default=2, help="runs per side and configuration")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per run")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per run")
    ap.add_argument("--steps-large", type=int, default=3, help="timed steps for models of >= 100M parameters")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--wait-quiet", type=float, default=1.0,
                    help="before each run wait until at most this fraction of the machine is busy (1: no wait)")
    ap.add_argument("--wait-quiet-max", type=float, default=300.0, help="longest such wait, s")
    ap.add_argument("--run-timeout", type=float, default=900.0, help="seconds per mpiexec")
    ap.add_argument("--machine-label", default=None, help="how the results name the machine")
    ap.add_argument("--work-dir", default=None, help="per-run JSON and logs (default: a temp dir)")
    ap.add_argument("--quick", action="store_true",
                    help="a minute's check: the tiny model, N = 2, 1 + 2 steps, to /tmp/compare_commits_quick.json")
    ap.add_argument("--out", default=None, help="JSON (default benchmarks/results/compare_commits_<machine>_<yyyymm>.json)")
    ap.add_argument("--replot", metavar="JSON", help="redraw the table and the PNG from an existing JSON")
    args = ap.parse_args(argv)
    if args.replot:
        doc = json.loads(Path(args.replot).read_text())
        print_table(doc)
        plot(doc, Path(args.replot).with_suffix(".png"))
        return 0
    if args.quick:
        given = {a.split("=")[0] for a in argv}
        for key, value in (("models", ["tiny"]), ("nranks", [2]), ("warmup", 1), ("steps", 2)):
            if f"--{key}" not in given:
                setattr(args, key, value)
        args.out = args.out or "/tmp/compare_commits_quick.json"  # a check, not a result
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    from harness import result_path

    args.out = args.out or str(result_path("compare_commits"))
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())
