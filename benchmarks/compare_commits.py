#!/usr/bin/env python
"""Compare two zerompi checkouts (BEFORE and AFTER a change) for step time and peak RSS.

    python benchmarks/compare_commits.py --before /tmp/zerompi-before --after . \
        --out benchmarks/results/compare_commits_vm-epyc_202611.json       (its PNG beside it)

Every run is one job of bench_dp.py's per-rank worker (system zerompi-<stage>, fp32): the
step bench_dp measures. The sides differ only in the zerompi the ranks import: they run
compare_sides.py, which imports it from the side's root and aborts if any rank got another
copy. The worker code is this checkout's (--worker shared) or each side's (--worker each).
Per configuration (model x N x stage) the runs alternate sides and the order flips every
repeat and configuration (ABBA, BAAB, ...), so a drift of the machine's load cancels out.
Results: each side's median step time over its timed steps, the after/before ratio and the
ratios of every pair of repeats, CPU seconds per step, peak RSS per rank, and checks that
both sides computed the same losses, memory_report and communication volume.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

from harness import DEFAULT_SHAPES, RANK_ENV, launch, machine_info, mem_info, software_info, wait_quiet
from compare_report import GiB, overall, plot, print_table, summarize
from compare_sides import EXTRA_BATCH, EXTRA_SHAPES, _tree_sha256, side_info

HERE = Path(__file__).resolve().parent
DEFAULT_BEFORE = "/tmp/zerompi-before"
DEFAULT_AFTER = str(HERE.parent)


def shape_of(model: str) -> tuple[int, int]:
    if model in EXTRA_BATCH:
        return EXTRA_BATCH[model]
    if model in DEFAULT_SHAPES:
        return DEFAULT_SHAPES[model]
    return 1, 256


def predicted_bytes(model: str, n: int, stage: int, bsz: int, seq: int) -> int | None:
    """All ranks' predicted peak (dp_driver's estimate), or None if it cannot be computed."""
    try:
        from dp_driver import predict_rank_bytes
        from dp_systems import _zerompi_default_bucket
        from zerompi.models.gpt import PRESETS, GPTConfig

        for name, kw in EXTRA_SHAPES.items():
            PRESETS[name] = GPTConfig(**kw)
        return n * predict_rank_bytes(f"zerompi-{stage}", model, n, bsz, seq,
                                      _zerompi_default_bucket(n, stage), True)
    except Exception:  # the checkout may be mid-change; the check is only a safeguard
        return None


def run_one(args, side: str, root: str, worker_dir: Path, cfg: dict, rep: int,
            work: Path) -> tuple[dict | None, dict | None]:
    tag = f"{cfg['model']}__n{cfg['n']}__s{cfg['stage']}__r{rep}__{side}"
    rfile = work / f"{tag}.json"
    rfile.unlink(missing_ok=True)
    worker_args = ["--system", cfg["system"], "--model", cfg["model"],
                   "--micro-batch", str(cfg["micro_batch"]), "--seq-len", str(cfg["seq_len"]),
                   "--warmup", str(args.warmup), "--steps", str(cfg["steps"]),
                   "--threads", "1", "--seed", str(args.seed), "--malloc-label", "default",
                   "--out", str(rfile)]
    if args.bucket_size:
        worker_args += ["--bucket-size", str(args.bucket_size)]
    if '"--worker"' in (Path(worker_dir) / "bench_dp.py").read_text():  # older ones run the worker by default
        worker_args.insert(0, "--worker")
    argv = [HERE / "compare_sides.py", "--worker-root", root, "--worker-dir", worker_dir, "--",
            *worker_args]
    wait_quiet(args.wait_quiet, args.wait_quiet_max)  # the machine is shared: other work skews timings
    code_sha = _tree_sha256(Path(root) / "zerompi")
    load0 = os.getloadavg()
    # PYTHONPATH starts with the side's root; an interrupt kills the job and propagates
    job = launch(cfg["n"], argv, timeout=args.run_timeout, root=root, log=work / f"{tag}.log")
    log, rc, wall = job.output, job.status, job.elapsed_s
    base = {"side": side, "model": cfg["model"], "n": cfg["n"], "stage": cfg["stage"],
            "repeat": rep, "wall_s": wall, "loadavg_before_launch": load0,
            "command": job.command_line, "log": str(work / f"{tag}.log"),
            # the code this run measured (the AFTER tree may be edited while a sweep runs)
            "zerompi_py_sha256": code_sha}
    if rc == 0 and rfile.exists():
        run = json.loads(rfile.read_text())
        run.update(base)
        return run, None
    base.update(returncode=rc, log_tail=log[-3000:])
    return None, base


def driver(args) -> None:
    import mpi4py

    mpi4py.rc.initialize = mpi4py.rc.finalize = False  # this process only reads versions
    before, after = os.path.realpath(args.before), os.path.realpath(args.after)
    for p in (before, after):
        if not (Path(p) / "zerompi" / "__init__.py").exists():
            sys.exit(f"{p}: no zerompi/__init__.py there")
    if before == after:
        print("[compare] warning: --before and --after are the same directory", flush=True)
    wdir = {s: (HERE if args.worker == "shared" else Path(r) / "benchmarks")
            for s, r in (("before", before), ("after", after))}
    roots = {"before": before, "after": after}
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="compare_commits_"))
    work.mkdir(parents=True, exist_ok=True)
    out, png = Path(args.out), (Path(args.png) if args.png else None)

    from zerompi.models.gpt import PRESETS

    configs = []
    for m in args.models:
        if m not in PRESETS and m not in EXTRA_SHAPES:
            sys.exit(f"--models {m}: not a zerompi.models.gpt preset nor one of {list(EXTRA_SHAPES)}")
        bsz, seq = shape_of(m)
        bsz, seq = args.micro_batch or bsz, args.seq_len or seq
        from zerompi.models.gpt import GPTConfig, count_params

        psi = count_params(GPTConfig(**EXTRA_SHAPES[m]) if m in EXTRA_SHAPES else PRESETS[m])
        steps = args.steps_large if psi >= args.large_params else args.steps
        for n in args.nranks:
            for st in args.stages:
                configs.append({"model": m, "n": n, "stage": st, "system": f"zerompi-{st}",
                                "micro_batch": bsz, "seq_len": seq, "steps": steps,
                                "params_count_params": psi})
    # ABBA per configuration; the first side flips from one configuration to the next
    plan = []
    for ci, cfg in enumerate(configs):
        for rep in range(args.repeats):
            first_before = (ci + rep) % 2 == 0
            for side in (("before", "after") if first_before else ("after", "before")):
                plan.append((ci, rep, side))

    software = software_info()
    for k in ("zerompi", "git_commit", "git_dirty"):  # per side below, not this process's
        software.pop(k, None)
    doc = {
        "benchmark": "compare_commits: zerompi BEFORE vs AFTER, step time and peak RSS per rank, "
                     "data parallel on CPU, fp32",
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "machine_label": args.machine_label, "machine": machine_info(), "software": software,
        "mem_available_bytes_at_start": mem_info().get("MemAvailable"),
        "loadavg_at_start": os.getloadavg(),
        "sides": {s: side_info(roots[s], wdir[s]) for s in ("before", "after")},
        "parameters": {
            "models": args.models, "nranks": args.nranks, "stages": args.stages,
            "repeats": args.repeats, "warmup": args.warmup, "steps": args.steps,
            "steps_large": args.steps_large, "large_params": args.large_params,
            "precision": "fp32", "threads_per_rank": 1, "seed": args.seed,
            "bucket_size": args.bucket_size or "engine default", "worker": args.worker,
            "quick": args.quick, "wait_quiet": args.wait_quiet,
            "extra_shapes": {m: EXTRA_SHAPES[m] for m in args.models if m in EXTRA_SHAPES},
            "shapes": {c["model"]: [c["micro_batch"], c["seq_len"]] for c in configs},
            "rank_env": RANK_ENV,
            "order": "per configuration, repeat r runs (before, after) if (config index + r) is "
                     "even else (after, before)",
            "timing": "bench_dp worker: per step a sleep-polling barrier, then fwd+bwd+optimizer "
                      "step; max over ranks per step; medians pooled over all timed steps of "
                      "all repeats of a side",
            "command": " ".join(shlex.quote(a) for a in sys.argv),
        },
        "plan": [{"config": ci, "repeat": r, "side": s} for ci, r, s in plan],
        "configs": [], "summary": {}, "runs": [], "failed": [], "skipped": [],
    }
    print(f"[compare] before: {before} ({doc['sides']['before']['git_commit']})\n"
          f"[compare] after:  {after} ({doc['sides']['after']['git_commit']}, "
          f"{len(doc['sides']['after']['git_dirty_files'])} changed files)\n"
          f"[compare] {len(configs)} configurations x {args.repeats} repeats x 2 sides = "
          f"{len(plan)} runs; per-run JSON and logs in {work}", flush=True)

    def write():
        doc["configs"] = [summarize(c, [r for r in doc["runs"] if (r["model"], r["n"], r["stage"])
                                        == (c["model"], c["n"], c["stage"])], args.warmup)
                          for c in configs]
        doc["summary"] = overall([c for c in doc["configs"]
                                  if c["before"]["runs"] and c["after"]["runs"]])
        # each side must have measured one version of zerompi throughout
        doc["summary"]["code_unchanged_during_sweep"] = all(
            len({r.get("zerompi_py_sha256") for r in doc["runs"] if r["side"] == s}) <= 1
            for s in ("before", "after"))
        doc["loadavg_at_end"] = os.getloadavg()
        doc["total_wall_s"] = time.monotonic() - t_all
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, indent=1))

    t_all = time.monotonic()
    skip, checked = set(), set()
    try:
        for i, (ci, rep, side) in enumerate(plan):
            cfg = configs[ci]
            if ci in skip:
                continue
            if ci not in checked:  # once per configuration, before its first run
                checked.add(ci)
                pred = predicted_bytes(cfg["model"], cfg["n"], cfg["stage"], cfg["micro_batch"],
                                       cfg["seq_len"])
                avail = mem_info().get("MemAvailable", 0)
                if pred and avail and pred > avail - GiB:
                    reason = f"predicted {pred / GiB:.1f} GiB > available {avail / GiB:.1f} - 1 GiB"
                    doc["skipped"].append({**cfg, "reason": reason})
                    print(f"[compare] skip {cfg['model']} N={cfg['n']} stage {cfg['stage']}: {reason}",
                          flush=True)
                    skip.add(ci)
                    continue
            run, fail = run_one(args, side, roots[side], wdir[side], cfg, rep, work)
            label = f"{cfg['model']} N={cfg['n']} stage {cfg['stage']} rep {rep} {side:6s}"
            el = time.monotonic() - t_all
            if run:
                doc["runs"].append(run)
                print(f"[compare] ({i + 1}/{len(plan)}, {el:5.0f}s) {label}: median step "
                      f"{run['step_time_s_median']:.3f}s, peak RSS/rank (steps) "
                      f"{(run.get('peak_rss_steps_bytes_max_rank') or 0) / GiB:.2f} GiB, "
                      f"load {run['loadavg_start'][0]:.1f}, wall {run['wall_s']:.0f}s", flush=True)
            else:
                doc["failed"].append(fail)
                print(f"[compare] ({i + 1}/{len(plan)}) FAILED {label} (rc={fail['returncode']}); "
                      f"log {fail['log']}\n{fail['log_tail'][-1500:]}", flush=True)
            write()  # after every run: an interrupted sweep keeps its results
    except KeyboardInterrupt:  # Ctrl-C, SIGTERM or SIGHUP: launch killed the running job
        print("[compare] interrupted; writing what finished", flush=True)
    write()
    print_table(doc)
    print(f"[compare] wrote {out} ({len(doc['runs'])} runs, {len(doc['failed'])} failed, "
          f"{len(doc['skipped'])} skipped configs) in {doc['total_wall_s']:.0f}s", flush=True)
    if png:
        plot(doc, str(png))
        print(f"[compare] wrote {png}", flush=True)
    if doc["failed"]:
        sys.exit(1)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", default=DEFAULT_BEFORE, help="checkout BEFORE the change")
    ap.add_argument("--after", default=DEFAULT_AFTER, help="checkout AFTER (default: this repository)")
    ap.add_argument("--models", nargs="+", default=["gpt-17m", "gpt-135m"],
                    help=f"zerompi.models.gpt presets or {list(EXTRA_SHAPES)}")
    ap.add_argument("--stages", nargs="+", type=int, default=[1, 2, 3], choices=[0, 1, 2, 3])
    ap.add_argument("--nranks", nargs="+", type=int, default=[2, 4])
    ap.add_argument("--repeats", type=int, default=2, help="runs per side and configuration")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per run")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per run")
    ap.add_argument("--steps-large", type=int, default=3,
                    help="timed steps per run for models with >= --large-params parameters")
    ap.add_argument("--large-params", type=int, default=100_000_000)
    ap.add_argument("--micro-batch", type=int, default=0, help="sequences per rank (0: per model)")
    ap.add_argument("--seq-len", type=int, default=0, help="tokens per sequence (0: per model)")
    ap.add_argument("--bucket-size", type=int, default=0, help="zerompi bucket_size (0: default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--worker", default="shared", choices=["shared", "each"],
                    help="shared: the bench_dp worker next to this script for both sides; "
                         "each: every side's own benchmarks/bench_dp.py")
    ap.add_argument("--wait-quiet", type=float, default=1.0,
                    help="before each run wait until at most this fraction of the machine is busy (1: no wait)")
    ap.add_argument("--wait-quiet-max", type=float, default=300.0, help="longest such wait, s")
    ap.add_argument("--run-timeout", type=float, default=900.0, help="seconds per mpiexec")
    ap.add_argument("--machine-label", default=None,
                    help='how the results name the machine, e.g. "vm, 2-core AMD EPYC, 24 GiB, ..."')
    ap.add_argument("--work-dir", default=None, help="per-run JSON and logs (default: a temp dir)")
    ap.add_argument("--quick", action="store_true",
                    help="smoke test: tiny model, N=2, stages 1-3, 1+2 steps, 2 repeats, "
                         "output to /tmp/compare_commits_quick.{json,png} unless given")
    ap.add_argument("--out", default=None,
                    help="JSON (default benchmarks/results/compare_commits_vm-epyc_202611.json)")
    ap.add_argument("--png", default=None,
                    help="plot (default: the JSON path with .png; 'none' for no plot)")
    ap.add_argument("--replot", metavar="JSON", default=None,
                    help="only redraw the plot (and the table) from an existing JSON")
    args = ap.parse_args(argv)
    if args.replot:
        doc = json.loads(Path(args.replot).read_text())
        print_table(doc)
        plot(doc, args.png or str(Path(args.replot).with_suffix(".png")))
        return
    if args.quick:
        given = set(a.split("=")[0] for a in argv)
        if "--models" not in given:
            args.models = ["tiny"]
        if "--nranks" not in given:
            args.nranks = [2]
        if "--warmup" not in given:
            args.warmup = 1
        if "--steps" not in given:
            args.steps = 2
        args.out = args.out or "/tmp/compare_commits_quick.json"
    args.out = args.out or str(HERE / "results" / "compare_commits_vm-epyc_202611.json")
    if args.png is None:
        args.png = str(Path(args.out).with_suffix(".png"))
    elif args.png == "none":
        args.png = None
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    driver(args)


if __name__ == "__main__":
    main()
