#!/usr/bin/env python
"""Compare two zerompi checkouts (BEFORE and AFTER a change) for step time and peak RSS.

    python benchmarks/compare_commits.py --before /tmp/zerompi-before --after . \\
        --out benchmarks/results/compare_commits.json --png benchmarks/results/compare_commits.png

Every run is one `mpiexec -n N` of the data-parallel benchmark's own per-rank worker
(`bench_dp.py`, system `zerompi-<stage>`, fp32), so a step is exactly the one
benchmarks/results/dp_cpu*.json measure: a sleep-polling barrier, then forward + backward +
optimizer step, timed as the maximum over ranks. The two sides differ only in which
`zerompi` package the ranks import: the worker runs under this script's `--worker-root`
mode, which puts the side's root first on sys.path, imports `zerompi` from there before
anything else, and aborts the run if any rank got another copy (it prints
`zerompi.__file__` once, and records every loaded zerompi module's file).

The worker code is, by default, the one next to this script (`--worker shared`), for both
sides; `--worker each` runs each side's own `benchmarks/bench_dp.py` instead.

For each configuration (model x N x stage) the runs alternate sides, and the order flips
every repeat and every configuration (ABBA, BAAB, ...), so slow drift of the machine's
load cancels out. Results: per configuration, the median step time of each side over all
its timed steps (pooled over repeats), the after/before ratio, the ratios of every
before/after pair of repeats, CPU seconds per step, peak RSS per rank, and checks that
both sides computed the same thing (losses, memory_report, communication volume).
See benchmarks/README.md ("compare_commits.py").
"""
from __future__ import annotations

import argparse
import datetime as _dt
import hashlib
import json
import math
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_BEFORE = "/tmp/zerompi-before"
DEFAULT_AFTER = str(HERE.parent)
GiB = 1 << 30

# Shapes that are not zerompi.models.gpt presets, as GPTConfig keyword arguments. They are
# added to PRESETS inside this script's processes only (zerompi itself is not touched).
# "gpt-135m": byte-level, GPT-2-small width (768, 12 heads) and 19 blocks: 135,654,144 params.
# "gpt-17m": gpt-20m's depth (6) at width 480 (8 heads): 16,872,960 params.
EXTRA_SHAPES = {
    "gpt-135m": dict(vocab_size=256, block_size=1024, n_layer=19, n_head=12, n_embd=768),
    "gpt-17m": dict(vocab_size=256, block_size=256, n_layer=6, n_head=8, n_embd=480),
}
# Per-rank micro-batch (sequences, tokens each) for the extra shapes: like gpt-200m / gpt-20m.
EXTRA_BATCH = {"gpt-135m": (1, 256), "gpt-17m": (4, 256)}
WORKER_FILES = ("bench_dp.py", "dp_systems.py", "dp_driver.py", "bench_env.py")


# --------------------------------------------------------------------------- worker side
def worker_main(root: str, worker_dir: str, argv: list[str]) -> None:
    """Runs on every rank under mpiexec: import zerompi from `root`, then bench_dp's worker."""
    root = os.path.realpath(root)
    sys.path.insert(0, root)
    import zerompi  # before bench_env, which puts its own repository first on sys.path

    got = os.path.realpath(zerompi.__file__)
    if not got.startswith(root + os.sep):
        raise SystemExit(f"[compare] zerompi imported from {got}, expected under {root}")
    sys.path.insert(0, worker_dir)
    import bench_dp  # noqa: E402  (also imports bench_env, dp_systems, dp_driver)
    import bench_env

    bench_root = str(bench_env.ROOT)
    if os.path.realpath(bench_root) != root:  # bench_env inserted the other checkout: drop it
        sys.path[:] = [p for p in sys.path if p != bench_root]
    from zerompi.models.gpt import PRESETS, GPTConfig

    for name, kw in EXTRA_SHAPES.items():  # always ours: both sides must build the same shape
        PRESETS[name] = GPTConfig(**kw)
    from mpi4py import MPI

    rank = MPI.COMM_WORLD.Get_rank()
    if rank == 0:
        print(f"[compare] zerompi from {zerompi.__file__} (worker {worker_dir}/bench_dp.py)",
              flush=True)
    bench_dp.main(argv)
    # every zerompi module any code path loaded must come from the same checkout
    files = sorted({os.path.realpath(f) for n, m in list(sys.modules.items())
                    if (n == "zerompi" or n.startswith("zerompi."))
                    and (f := getattr(m, "__file__", None))})
    foreign = [f for f in files if not f.startswith(root + os.sep)]
    foreign = MPI.COMM_WORLD.allreduce(foreign)  # every rank's
    if rank == 0:
        out = argv[argv.index("--out") + 1]
        res = json.loads(Path(out).read_text())
        res["zerompi_file"] = os.path.realpath(zerompi.__file__)
        res["zerompi_version"] = getattr(zerompi, "__version__", None)
        res["zerompi_modules_loaded"] = len(files)
        res["zerompi_foreign_modules"] = sorted(set(foreign))
        Path(out).write_text(json.dumps(res, indent=1))
    if foreign:
        raise SystemExit(f"[compare] zerompi modules from outside {root}: {sorted(set(foreign))}")


# --------------------------------------------------------------------------- driver side
def _git(root: str, *args: str) -> str | None:
    try:  # read-only plumbing; --no-optional-locks: never refresh the index
        p = subprocess.run(["git", "--no-optional-locks", "-C", root, *args],
                           capture_output=True, text=True, timeout=60)
        return p.stdout.rstrip() if p.returncode == 0 else None  # porcelain lines start with " "
    except (OSError, subprocess.TimeoutExpired):
        return None


def _tree_sha256(directory: Path, pattern: str = "*.py") -> str | None:
    if not directory.is_dir():
        return None
    h = hashlib.sha256()
    for f in sorted(directory.rglob(pattern)):
        if "__pycache__" in f.parts:
            continue
        h.update(str(f.relative_to(directory)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def side_info(root: str, worker_dir: Path) -> dict:
    status = _git(root, "status", "--porcelain")
    return {
        "path": root,
        "git_commit": _git(root, "rev-parse", "HEAD"),
        "git_subject": _git(root, "log", "-1", "--format=%s"),
        "git_dirty_files": status.splitlines() if status else [],
        # identifies uncommitted code too: every zerompi/**/*.py, path and content
        "zerompi_py_sha256": _tree_sha256(Path(root) / "zerompi"),
        "worker_dir": str(worker_dir),
        "worker_files_sha256": {f: hashlib.sha256((worker_dir / f).read_bytes()).hexdigest()
                                for f in WORKER_FILES if (worker_dir / f).exists()},
    }


def shape_of(model: str) -> tuple[int, int]:
    sys.path.insert(0, str(HERE))
    from bench_env import DEFAULT_SHAPES

    if model in EXTRA_BATCH:
        return EXTRA_BATCH[model]
    if model in DEFAULT_SHAPES:
        return DEFAULT_SHAPES[model]
    return 1, 256


def predicted_bytes(model: str, n: int, stage: int, bsz: int, seq: int) -> int | None:
    """All ranks' predicted peak (dp_driver's estimate), or None if it cannot be computed."""
    try:
        sys.path.insert(0, str(HERE))
        from dp_driver import predict_rank_bytes
        from dp_systems import _zerompi_default_bucket
        from zerompi.models.gpt import PRESETS, GPTConfig

        for name, kw in EXTRA_SHAPES.items():
            PRESETS[name] = GPTConfig(**kw)
        return n * predict_rank_bytes(f"zerompi-{stage}", model, n, bsz, seq,
                                      _zerompi_default_bucket(), True)
    except Exception:  # the checkout may be mid-change; the check is only a safeguard
        return None


def _median(xs):
    return statistics.median(xs) if xs else None


def _ratio(a, b):
    return a / b if (a is not None and b) else None


def _loss_diff(a: list, b: list) -> float | None:
    if not a or not b or len(a) != len(b):
        return None
    return max(abs(x - y) for x, y in zip(a, b))


def _volume(comm_stats: dict | None) -> dict | None:
    if not isinstance(comm_stats, dict):
        return None
    return {k: {kk: vv for kk, vv in v.items() if kk != "seconds"} if isinstance(v, dict) else v
            for k, v in comm_stats.items()}


def summarize(cfg: dict, runs: list[dict], warmup: int) -> dict:
    """Per-configuration statistics from its finished runs (worker JSON + driver fields)."""
    out = {k: cfg[k] for k in ("model", "n", "stage", "system")}
    per = {}
    for side in ("before", "after"):
        rs = [r for r in runs if r["side"] == side]
        steps = [t for r in rs for t in r["step_time_s_per_step"][warmup:]]
        # CPU seconds per timed step, mean over ranks
        cpu = [statistics.mean(rk["step_cpu_s"][i] for rk in r["ranks"])
               for r in rs for i in range(warmup, len(r["step_time_s_per_step"]))]
        peak_steps = [r.get("peak_rss_steps_bytes_max_rank") for r in rs]
        peak_proc = [r["peak_rss_process_bytes_max_rank"] for r in rs]
        per[side] = {
            "runs": len(rs),
            "step_time_s_median": _median(steps),
            "step_time_s_per_repeat_median": [r["step_time_s_median"] for r in rs],
            "step_time_s_samples": steps,
            "step_cpu_s_median": _median(cpu),
            "step_cpu_s_samples": cpu,
            "peak_rss_steps_bytes_max_rank_median": _median([p for p in peak_steps if p]),
            "peak_rss_steps_bytes_per_rank": [[rk.get("peak_rss_steps") for rk in r["ranks"]]
                                              for r in rs],
            "peak_rss_process_bytes_max_rank_median": _median(peak_proc),
            "peak_rss_process_bytes_per_rank": [[rk["peak_rss_process"] for rk in r["ranks"]]
                                                for r in rs],
            "setup_s_max_rank": [max(rk["setup_s"] for rk in r["ranks"]) for r in rs],
            "wall_s": [r["wall_s"] for r in rs],
            "loadavg_start": [r.get("loadavg_start") for r in rs],
        }
        if rs:
            out["params"] = rs[0]["params"]
            out["micro_batch"], out["seq_len"] = rs[0]["micro_batch"], rs[0]["seq_len"]
            out["oversubscribed"] = rs[0].get("oversubscribed")
    out.update(per)
    b, a = per["before"], per["after"]
    out["ratio_step_time"] = _ratio(a["step_time_s_median"], b["step_time_s_median"])
    out["ratio_step_cpu"] = _ratio(a["step_cpu_s_median"], b["step_cpu_s_median"])
    out["ratio_peak_rss_steps"] = _ratio(a["peak_rss_steps_bytes_max_rank_median"],
                                         b["peak_rss_steps_bytes_max_rank_median"])
    out["ratio_peak_rss_process"] = _ratio(a["peak_rss_process_bytes_max_rank_median"],
                                           b["peak_rss_process_bytes_max_rank_median"])
    # every (after repeat, before repeat) pair of per-run medians: the spread of the ratio
    pairs = [x / y for x in a["step_time_s_per_repeat_median"]
             for y in b["step_time_s_per_repeat_median"] if y]
    out["ratio_step_time_pairs"] = pairs
    # how much one side differs from itself between repeats (max/min of its run medians):
    # a ratio inside this spread is indistinguishable from noise
    out["repeat_spread"] = {s: (max(v) / min(v) if len(v) > 1 and min(v) > 0 else None)
                            for s, v in ((s, per[s]["step_time_s_per_repeat_median"])
                                         for s in ("before", "after"))}
    # same computation on both sides? (fp32, same seed, same batches)
    rb = [r for r in runs if r["side"] == "before"]
    ra = [r for r in runs if r["side"] == "after"]
    if rb and ra:
        out["loss_max_abs_diff_after_vs_before"] = _loss_diff(ra[0]["loss_per_step"],
                                                              rb[0]["loss_per_step"])
        out["loss_max_abs_diff_between_repeats"] = max(
            [d for rs in (rb, ra) for r in rs[1:]
             if (d := _loss_diff(r["loss_per_step"], rs[0]["loss_per_step"])) is not None],
            default=None)
        out["params_equal"] = rb[0]["params"] == ra[0]["params"]
        mb = [rk.get("memory_report") for rk in rb[0]["ranks"]]
        ma = [rk.get("memory_report") for rk in ra[0]["ranks"]]
        out["memory_report_equal"] = mb == ma
        out["comm_volume_equal"] = ([_volume(rk.get("comm_stats")) for rk in rb[0]["ranks"]]
                                    == [_volume(rk.get("comm_stats")) for rk in ra[0]["ranks"]])
        if not out["memory_report_equal"]:
            out["memory_report"] = {"before": mb, "after": ma}
    return out


def overall(configs: list[dict]) -> dict:
    rs = [c["ratio_step_time"] for c in configs if c.get("ratio_step_time")]
    rc = [c["ratio_step_cpu"] for c in configs if c.get("ratio_step_cpu")]
    rm = [c["ratio_peak_rss_steps"] for c in configs if c.get("ratio_peak_rss_steps")]
    gm = lambda v: math.exp(statistics.mean(math.log(x) for x in v)) if v else None  # noqa: E731
    worst = max((c for c in configs if c.get("ratio_step_time")),
                key=lambda c: c["ratio_step_time"], default=None)
    return {
        "configs": len(configs),
        "geomean_ratio_step_time": gm(rs), "geomean_ratio_step_cpu": gm(rc),
        "geomean_ratio_peak_rss_steps": gm(rm),
        "max_ratio_step_time": worst and worst["ratio_step_time"],
        "max_ratio_step_time_config": worst and f"{worst['model']} N={worst['n']} stage {worst['stage']}",
        "max_ratio_peak_rss_steps": max(rm, default=None),
        "all_params_equal": all(c.get("params_equal") for c in configs),
        "all_losses_equal": all(c.get("loss_max_abs_diff_after_vs_before") == 0.0 for c in configs),
        "all_memory_reports_equal": all(c.get("memory_report_equal") for c in configs),
        "all_comm_volumes_equal": all(c.get("comm_volume_equal") for c in configs),
    }


def _descendants(pid: int) -> list[int]:
    """All live descendants of pid (from /proc): MPICH's ranks get process groups of their own."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def kill_run(p) -> None:
    """SIGKILL one mpiexec this script started: its process group and every descendant."""
    victims = _descendants(p.pid)
    for sig_target in (lambda: os.killpg(p.pid, signal.SIGKILL),
                       *[(lambda c=c: os.kill(c, signal.SIGKILL)) for c in victims]):
        try:
            sig_target()
        except (ProcessLookupError, PermissionError):
            pass


def run_one(args, side: str, root: str, worker_dir: Path, cfg: dict, rep: int, work: Path,
            procs: list) -> tuple[dict | None, dict | None]:
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
    cmd = ["mpiexec", "-n", str(cfg["n"]), sys.executable, "-m", "mpi4py", str(Path(__file__).resolve()),
           "--worker-root", root, "--worker-dir", str(worker_dir), "--", *worker_args]
    sys.path.insert(0, str(HERE))
    from bench_env import RANK_ENV

    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    env.update(RANK_ENV)  # GLOO_SOCKET_IFNAME/UCX_NET_DEVICES=lo, OMP/MKL_NUM_THREADS=1
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    if args.wait_quiet > 0:
        deadline = time.monotonic() + args.wait_quiet_max
        while os.getloadavg()[0] > args.wait_quiet and time.monotonic() < deadline:
            time.sleep(10)
    code_sha = _tree_sha256(Path(root) / "zerompi")
    load0 = os.getloadavg()
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=env, start_new_session=True)
    procs.append(p)
    try:
        log, _ = p.communicate(timeout=args.run_timeout)
        rc = p.returncode
    except subprocess.TimeoutExpired:
        kill_run(p)  # only the processes this script started
        log, _ = p.communicate()
        rc = "timeout"
    except BaseException:  # Ctrl-C (the ranks are in another session) or SIGTERM
        kill_run(p)
        p.wait()
        raise
    finally:
        procs.remove(p)
    wall = time.monotonic() - t0
    (work / f"{tag}.log").write_text(log)
    base = {"side": side, "model": cfg["model"], "n": cfg["n"], "stage": cfg["stage"],
            "repeat": rep, "wall_s": wall, "loadavg_before_launch": load0,
            "command": " ".join(shlex.quote(c) for c in cmd), "log": str(work / f"{tag}.log"),
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
    sys.path.insert(0, str(HERE))
    from bench_env import RANK_ENV, machine_info, mem_info, software_info

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
        "machine": machine_info(), "software": software,
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

    procs: list = []

    def on_term(signum, frame):  # kill our mpiexec and its ranks, then stop
        for p in list(procs):
            kill_run(p)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
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
            run, fail = run_one(args, side, roots[side], wdir[side], cfg, rep, work, procs)
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
    except KeyboardInterrupt:
        print("[compare] interrupted; writing what finished", flush=True)
        for p in list(procs):
            kill_run(p)
    write()
    print_table(doc)
    print(f"[compare] wrote {out} ({len(doc['runs'])} runs, {len(doc['failed'])} failed, "
          f"{len(doc['skipped'])} skipped configs) in {doc['total_wall_s']:.0f}s", flush=True)
    if png:
        plot(doc, str(png))
        print(f"[compare] wrote {png}", flush=True)
    if doc["failed"]:
        sys.exit(1)


def print_table(doc: dict) -> None:
    f = lambda v, d=3: "-" if v is None else f"{v:.{d}f}"  # noqa: E731
    print(f"{'model':9s} {'N':>2s} {'st':>2s} | {'before s':>8s} {'after s':>8s} {'ratio':>6s} "
          f"{'pairs':>13s} {'cpu r':>6s} | {'RSS b GiB':>9s} {'RSS a GiB':>9s} {'ratio':>6s} | "
          f"{'loss=':>5s} {'mem=':>4s} {'comm=':>5s}")
    for c in doc["configs"]:
        b, a = c["before"], c["after"]
        pr = c["ratio_step_time_pairs"]
        rng = f"{min(pr):.3f}-{max(pr):.3f}" if pr else "-"
        rb, ra = b["peak_rss_steps_bytes_max_rank_median"], a["peak_rss_steps_bytes_max_rank_median"]
        d = c.get("loss_max_abs_diff_after_vs_before")
        loss_eq = None if d is None else d == 0.0
        print(f"{c['model']:9s} {c['n']:2d} {c['stage']:2d} | {f(b['step_time_s_median']):>8s} "
              f"{f(a['step_time_s_median']):>8s} {f(c['ratio_step_time']):>6s} {rng:>13s} "
              f"{f(c['ratio_step_cpu']):>6s} | {f(rb and rb / GiB, 2):>9s} {f(ra and ra / GiB, 2):>9s} "
              f"{f(c['ratio_peak_rss_steps']):>6s} | "
              f"{str(loss_eq):>5s} "
              f"{str(c.get('memory_report_equal')):>4s} {str(c.get('comm_volume_equal')):>5s}")
    s = doc.get("summary", {})
    if s.get("geomean_ratio_step_time"):
        print(f"geomean after/before: step time {s['geomean_ratio_step_time']:.3f}, CPU s/step "
              f"{s['geomean_ratio_step_cpu']:.3f}, peak RSS {s['geomean_ratio_peak_rss_steps']:.3f}; "
              f"worst step-time ratio {s['max_ratio_step_time']:.3f} ({s['max_ratio_step_time_config']})")


def plot(doc: dict, png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cs = [c for c in doc["configs"] if c.get("ratio_step_time")]
    if not cs:
        print("[compare] nothing to plot", flush=True)
        return
    labels = [f"{c['model']}\nN={c['n']} s{c['stage']}" for c in cs]
    x = list(range(len(cs)))
    fig, (ax_t, ax_m) = plt.subplots(2, 1, figsize=(max(9.0, 0.9 * len(cs) + 3), 8.5), sharex=True)
    stage_col = {1: "#6baed6", 2: "#2171b5", 3: "#08306b"}
    for xi, c in zip(x, cs):
        col = stage_col.get(c["stage"], "grey")
        r, pr = c["ratio_step_time"], c["ratio_step_time_pairs"] or [c["ratio_step_time"]]
        ax_t.errorbar(xi, r, yerr=[[max(0.0, r - min(pr))], [max(0.0, max(pr) - r)]], fmt="o",
                      color=col, ms=7, capsize=4, zorder=3)
        if c.get("ratio_step_cpu"):
            ax_t.plot(xi + 0.22, c["ratio_step_cpu"], "D", mfc="white", mec=col, ms=5, zorder=3)
        ax_t.annotate(f"{c['before']['step_time_s_median']:.3g}\u2192{c['after']['step_time_s_median']:.3g}s",
                      (xi, r), textcoords="offset points", xytext=(0, 9), ha="center", fontsize=7)
        if c.get("ratio_peak_rss_steps"):
            ax_m.plot(xi, c["ratio_peak_rss_steps"], "o", color=col, ms=7, zorder=3)
            b = c["before"]["peak_rss_steps_bytes_max_rank_median"] / GiB
            a = c["after"]["peak_rss_steps_bytes_max_rank_median"] / GiB
            ax_m.annotate(f"{b:.2f}\u2192{a:.2f}", (xi, c["ratio_peak_rss_steps"]),
                          textcoords="offset points", xytext=(0, 9), ha="center", fontsize=7)
        if c.get("ratio_peak_rss_process"):
            ax_m.plot(xi + 0.22, c["ratio_peak_rss_process"], "s", mfc="white", mec=col, ms=5, zorder=3)
    # group separators between models
    for xi in range(1, len(cs)):
        if cs[xi]["model"] != cs[xi - 1]["model"]:
            for ax in (ax_t, ax_m):
                ax.axvline(xi - 0.5, color="black", lw=0.6, alpha=0.5)
    for ax in (ax_t, ax_m):
        ax.axhline(1.0, color="black", lw=1.0)
        ax.grid(axis="y", alpha=0.3)
        ax.set_axisbelow(True)
        lo, hi = ax.get_ylim()
        ax.set_ylim(min(lo, 0.9), max(hi, 1.1))
    ax_t.set_ylabel("AFTER / BEFORE, median step time\n(whiskers: all repeat pairs)")
    ax_m.set_ylabel("AFTER / BEFORE, peak RSS per rank\n(max over ranks, during steps)")
    ax_m.set_xlim(-0.5, len(cs) - 0.5)
    ax_m.set_xticks(x)
    ax_m.set_xticklabels(labels, fontsize=8)
    handles = [plt.Line2D([], [], color=stage_col[s], marker="o", ls="", label=f"stage {s}")
               for s in sorted({c["stage"] for c in cs}) if s in stage_col]
    handles += [plt.Line2D([], [], color="black", marker="D", mfc="white", ls="", ms=5,
                           label="CPU s/step ratio"),
                plt.Line2D([], [], color="black", marker="s", mfc="white", ls="", ms=5,
                           label="whole-process peak RSS ratio")]
    fig.legend(handles=handles, fontsize=8, loc="lower center", ncol=len(handles), frameon=False)
    m, sd, p = doc.get("machine", {}), doc.get("sides", {}), doc.get("parameters", {})
    com = lambda s: ((sd.get(s, {}).get("git_commit") or "?")[:8]  # noqa: E731
                     + ("+dirty" if sd.get(s, {}).get("git_dirty_files") else ""))
    la0, la1 = doc.get("loadavg_at_start", [0])[0], doc.get("loadavg_at_end", [0])[0]
    sm = doc.get("summary", {})
    fig.suptitle(
        f"zerompi AFTER ({com('after')}) / BEFORE ({com('before')}): fp32 AdamW on CPU, "
        f"1 thread/rank, {p.get('repeats')} repeats per side in alternating order\n"
        f"machine: {m.get('node', '?')}, {m.get('cpu_model', '?')}, {m.get('cores', '?')} cores, "
        f"{(m.get('ram_bytes') or 0) / GiB:.0f} GiB RAM; 1-min load average {la0:.1f} at start, "
        f"{la1:.1f} at end"
        + (f"\ngeomean step-time ratio {sm['geomean_ratio_step_time']:.3f}, worst "
           f"{sm['max_ratio_step_time']:.3f} ({sm['max_ratio_step_time_config']})"
           if sm.get("geomean_ratio_step_time") else ""), fontsize=9)
    fig.tight_layout(rect=(0, 0.03, 1, 0.95))
    fig.savefig(png, dpi=130)
    plt.close(fig)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--worker-root":  # per-rank mode, started by the driver
        sep = argv.index("--")
        opts = dict(zip(argv[:sep:2], argv[1:sep:2]))
        worker_main(opts["--worker-root"], opts.get("--worker-dir", str(HERE)), argv[sep + 1:])
        return
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
    ap.add_argument("--wait-quiet", type=float, default=0.0,
                    help="before each run wait until the 1-min load average is below this (0: off)")
    ap.add_argument("--wait-quiet-max", type=float, default=300.0, help="longest such wait, s")
    ap.add_argument("--run-timeout", type=float, default=900.0, help="seconds per mpiexec")
    ap.add_argument("--work-dir", default=None, help="per-run JSON and logs (default: a temp dir)")
    ap.add_argument("--quick", action="store_true",
                    help="smoke test: tiny model, N=2, stages 1-3, 1+2 steps, 2 repeats, "
                         "output to /tmp/compare_commits_quick.{json,png} unless given")
    ap.add_argument("--out", default=None,
                    help="JSON (default benchmarks/results/compare_commits.json)")
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
    args.out = args.out or str(HERE / "results" / "compare_commits.json")
    if args.png is None:
        args.png = str(Path(args.out).with_suffix(".png"))
    elif args.png == "none":
        args.png = None
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    driver(args)


if __name__ == "__main__":
    main()
