#!/usr/bin/env python
"""Data-parallel CPU benchmark: zerompi stages 0-3 vs torch DDP, ZeroRedundancyOptimizer,
FSDP2 and DeepSpeed ZeRO.

The driver loops systems x models x N, one mpiexec job of this file's
--worker mode each (so peak RSS belongs to one system), merges the per-run JSON into one
file and draws the PNG next to it; --replot redraws it:

    python benchmarks/bench_dp.py --out benchmarks/results/dp_vm-epyc_202611.json
    python benchmarks/bench_dp.py --replot benchmarks/results/dp_vm-epyc_202611.json
    mpiexec -n 2 python -m mpi4py benchmarks/bench_dp.py --worker --system zerompi-3 --out r.json

Systems (dp_systems.py): zerompi-0/1/2/3 (fp32, "-bf16" for bf16; zerompi-3 under
zerompi.Init), ddp, torch-zero (ZeroRedundancyOptimizer over DDP), fsdp2 (fully_shard per
block + root), deepspeed-1/2/3 (its CPU accelerator; stage 3 under deepspeed.zero.Init); torch
and DeepSpeed over gloo. All train the same GPT from the same weights on the same per-rank
batches with the same AdamW.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

from harness import (DEFAULT_SHAPES, HERE, GiB, RANK_ENV, current_rss, launch, machine_info, mem_info,
                     peak_rss_process, pyplot, quiet_barrier, reset_hwm, result_path, save_figure, software_info,
                     vm_hwm, wait_quiet, write_json)
from dp_systems import (OPTIONAL_SYSTEMS, SYSTEMS, build_system, default_bucket, expected_model_state_bytes,
                        parse_system)


def worker(args) -> None:
    for k, v in RANK_ENV.items():
        os.environ.setdefault(k, v)
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    rss_start = current_rss()
    load_start = os.getloadavg()  # other work on the machine skews the timings
    import torch

    torch.set_num_threads(1)
    from zerompi.models.gpt import PRESETS, count_params

    kind = parse_system(args.system)[0]
    # the system's own libraries belong to its runtime baseline, not to its model states
    if kind == "deepspeed":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # chosen at import
        os.environ.setdefault("DS_BUILD_OPS", "0")
        import deepspeed  # noqa: F401
    elif kind == "fsdp2":
        import torch.distributed.fsdp  # noqa: F401
    rss_runtime = current_rss()  # python + MPI + torch (+ deepspeed), no model yet

    cfg = PRESETS[args.model]
    bsz, seq = DEFAULT_SHAPES.get(args.model, (1, cfg.block_size))
    bsz, seq = args.micro_batch or bsz, args.seq_len or seq
    psi = count_params(cfg)  # == GPT(cfg).num_params(); no rank may hold the full model

    t_setup = time.perf_counter()
    marks = {"micro_batch": bsz}
    # same seed -> same initial weights for every system (built inside build_system,
    # since zerompi-3 and deepspeed-3 construct the model partitioned)
    fwd, bwd, step, info, cleanup = build_system(args, cfg, comm, marks)
    t_setup = time.perf_counter() - t_setup
    rss_imports = marks.get("rss_after_model")
    rss_setup = current_rss()

    def batch(i):  # per rank, per step; identical across systems
        g = torch.Generator().manual_seed(args.seed * 1_000_003 + rank * 10_007 + i)
        t = torch.randint(0, cfg.vocab_size, (bsz, seq + 1), generator=g)
        return t[:, :seq].contiguous(), t[:, 1:].contiguous()

    quiet_barrier(comm)
    hwm_reset = reset_hwm()
    times, cpu_times, losses = [], [], []
    for i in range(args.warmup + args.steps):
        x, y = batch(i)
        quiet_barrier(comm)
        t0, c0 = time.perf_counter(), time.process_time()
        _, loss = fwd(x, y)
        bwd(loss)
        step()
        times.append(time.perf_counter() - t0)
        # CPU seconds of all this rank's threads: ~wall when a rank computes or spins in
        # MPI, less when it sleeps (gloo waits) or when other processes share the cores
        cpu_times.append(time.process_time() - c0)
        losses.append(float(loss.detach()))
    peak_steps = vm_hwm() if hwm_reset else None
    rss_end = current_rss()
    peak_proc = peak_rss_process()
    extra = info()

    import numpy as np

    step_max = np.array(times)
    comm.Allreduce(MPI.IN_PLACE, step_max, op=MPI.MAX)
    loss_mean = np.array(losses)
    comm.Allreduce(MPI.IN_PLACE, loss_mean, op=MPI.SUM)
    loss_mean /= world
    per_rank = {"rank": rank, "host": platform.node(), "rss_start": rss_start,
                "rss_runtime": rss_runtime,
                "rss_after_model": rss_imports, "rss_after_setup": rss_setup, "rss_end": rss_end,
                "peak_rss_process": peak_proc, "peak_rss_steps": peak_steps,
                "step_times_s": times, "step_cpu_s": cpu_times, "setup_s": t_setup,
                "loadavg_end": os.getloadavg(), **extra}
    gathered = comm.gather(per_rank, root=0)
    cleanup()
    if rank != 0:
        return
    timed = [float(t) for t in step_max[args.warmup:]]
    med = statistics.median(timed)
    kind, stage, prec = parse_system(args.system)
    ncores = os.cpu_count() or 1
    res = {
        "system": args.system, "kind": kind, "stage": stage, "precision": prec,
        "model": args.model, "n": world, "params": psi, "micro_batch": bsz, "seq_len": seq,
        "tokens_per_step": world * bsz * seq, "warmup": args.warmup, "steps": args.steps,
        "threads_per_rank": 1, "oversubscribed": world > ncores,
        "optimizer": {"name": "AdamW", "lr": args.lr, "betas": [0.9, 0.95], "eps": 1e-8,
                      "weight_decay": args.weight_decay},
        "step_time_s_per_step": [float(t) for t in step_max],
        "step_time_s_median": med, "step_time_s_min": min(timed), "step_time_s_max": max(timed),
        "tokens_per_s": world * bsz * seq / med,
        "step_cpu_s_median_mean_rank": statistics.mean(
            statistics.median(r["step_cpu_s"][args.warmup:]) for r in gathered),
        "loadavg_start": load_start,
        "loss_per_step": [float(v) for v in loss_mean],
        "expected_model_states_bytes_per_rank": expected_model_state_bytes(args.system, psi, world),
        "peak_rss_process_bytes_max_rank": max(r["peak_rss_process"] for r in gathered),
        "peak_rss_steps_bytes_max_rank": (max(r["peak_rss_steps"] for r in gathered)
                                          if all(r["peak_rss_steps"] for r in gathered) else None),
        "rss_end_bytes_max_rank": max(r["rss_end"] for r in gathered),
        "model_states_bytes_max_rank": max(r["model_states_bytes"] for r in gathered),
        "ranks": gathered,
        "env": {k: os.environ.get(k) for k in sorted(RANK_ENV) + ["MALLOC_MMAP_THRESHOLD_"]},
        "command": " ".join(shlex.quote(a) for a in sys.argv),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(f"[bench_dp] {args.system:15s} {args.model:9s} N={world}: "
          f"median step {med:.3f}s (cpu {res['step_cpu_s_median_mean_rank']:.3f}s/rank), "
          f"{res['tokens_per_s']:.0f} tok/s, "
          f"peak RSS/rank {res['peak_rss_process_bytes_max_rank'] / GiB:.2f} GiB "
          f"(steps {((res['peak_rss_steps_bytes_max_rank'] or 0) / GiB):.2f} GiB)", flush=True)


# ------------------------------------------------------------------ the driver
FORMULAS = {"zerompi-0 / ddp": "16*Psi", "zerompi-1 / torch-zero / deepspeed-1 (fp32)": "8*Psi + 8*Psi/N",
            "zerompi-2 / deepspeed-2 (fp32)": "4*Psi + 12*Psi/N", "zerompi-3 / fsdp2 / deepspeed-3": "16*Psi/N",
            "zerompi-1 (bf16)": "4*Psi + 12*Psi/N", "zerompi-2 (bf16)": "2*Psi + 14*Psi/N"}


def shape_of(args, model: str) -> tuple[int, int]:
    from zerompi.models.gpt import PRESETS

    bsz, seq = DEFAULT_SHAPES.get(model, (1, PRESETS[model].block_size))
    return args.micro_batch or bsz, args.seq_len or seq


def predict_rank_bytes(system: str, cfg, n: int, bsz: int, seq: int, bucket: int) -> int:
    """A rough per-rank peak (runtime + model states + buffers + activations), only to skip
    runs that could exhaust the machine's memory; set-up transients from this machine's runs."""
    from zerompi.models.gpt import count_params

    psi = count_params(cfg)
    kind, stage, _ = parse_system(system)
    states, block, bucket = expected_model_state_bytes(system, psi, n), 12 * cfg.n_embd ** 2, 4 * min(bucket, psi)
    extra = {  # zerompi-3: Init's freed full temporaries stay resident under the default malloc
        "zerompi": 4 * psi + 4 * bucket + 24 * block if stage == 3 else max(0, 8 * psi - states) + 4 * bucket,
        "fsdp2": max(0, 4 * psi + 4 * psi // n - states) + 24 * block,  # built full, then sharded
        # its fp32 partition copy and buckets; stage 3 keeps gathered parameters from forward to backward
        "deepspeed": 4 * psi // n + 2 * bucket + (14 * psi if stage == 3 else 2 * bucket),
    }.get(kind, 0)  # DDP: gradients are views into its buckets
    act = bsz * seq * (cfg.n_layer * cfg.n_embd * 20 + cfg.vocab_size * 3) * 4  # saved fp32 activations
    return int(0.6 * GiB) + states + extra + act


def skip_reason(args, system: str, model: str, n: int) -> tuple[str | None, int]:
    from zerompi.models.gpt import PRESETS

    _, stage, prec = parse_system(system)
    bucket = args.bucket_size or default_bucket(n, stage or 0, prec)
    pred = n * predict_rank_bytes(system, PRESETS[model], n, *shape_of(args, model), bucket)
    avail = mem_info().get("MemAvailable", 0)
    if parse_system(system)[0] == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
        return "deepspeed is not installed", pred
    if pred > args.mem_limit_gib * GiB:
        return f"predicted {pred / GiB:.1f} GiB > limit {args.mem_limit_gib} GiB", pred
    if avail and pred > avail - GiB:
        return f"predicted {pred / GiB:.1f} GiB > available {avail / GiB:.1f} GiB - 1 GiB", pred
    return None, pred


def driver(args) -> None:
    import mpi4py

    mpi4py.rc.initialize = mpi4py.rc.finalize = False  # this process only reads versions: no MPI_Init
    from zerompi.models.gpt import PRESETS, count_params

    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench_dp_"))
    work.mkdir(parents=True, exist_ok=True)
    out = Path(args.out)
    doc = {"benchmark": "bench_dp: step time and per-rank RSS, data parallel on CPU", "machine": machine_info(),
           "software": software_info(), "loadavg_at_start": os.getloadavg(),
           "parameters": {**vars(args), "threads_per_rank": 1, "rank_env": RANK_ENV,
                          "shapes": {m: list(shape_of(args, m)) for m in args.models},
                          "timing": "per step: sleep-polling barrier, then fwd+bwd+optimizer step; "
                                    "max over ranks per step, median over timed steps"},
           "oversubscribed_n": [n for n in args.nranks if n > (os.cpu_count() or 1)],
           "formulas": FORMULAS, "runs": [], "skipped": [], "failed": []}
    plan = [(m, n, s) for m in args.models for n in args.nranks for s in args.systems]
    t_all = time.monotonic()
    for i, (m, n, s) in enumerate(plan):
        tag = f"{s}__{m}__n{n}"
        reason, pred = skip_reason(args, s, m, n)
        entry = {"system": s, "model": m, "n": n, "predicted_total_bytes": pred}
        if reason:
            doc["skipped"].append({**entry, "reason": reason})
            print(f"[driver] skip {tag}: {reason}", flush=True)
            continue
        wait_quiet(args.wait_quiet, args.wait_quiet_max)  # other work on the cores skews timings
        rfile = work / f"{tag}.json"
        bsz, seq = shape_of(args, m)
        steps = args.steps_large if count_params(PRESETS[m]) >= 100_000_000 else args.steps
        argv = [HERE / "bench_dp.py", "--worker", "--system", s, "--model", m, "--micro-batch", bsz,
                "--seq-len", seq, "--warmup", args.warmup, "--steps", steps, "--lr", args.lr,
                "--weight-decay", args.weight_decay, "--seed", args.seed, "--out", rfile,
                "--bucket-size", args.bucket_size]
        print(f"[driver] ({i + 1}/{len(plan)}) {tag}: predicted {pred / GiB:.1f} GiB", flush=True)
        try:
            job = launch(n, [str(a) for a in argv], timeout=args.run_timeout, log=work / f"{tag}.log")
        except KeyboardInterrupt:  # the job is killed; keep what finished
            print("[driver] interrupted; writing what finished", flush=True)
            break
        if job.ok and rfile.exists():
            doc["runs"].append({**json.loads(rfile.read_text()), "wall_s": job.elapsed_s,
                                "predicted_total_bytes": pred})
            print("".join(ln + "\n" for ln in job.output.splitlines() if ln.startswith("[bench_dp]")), end="")
        else:
            doc["failed"].append({**entry, "returncode": job.status, "wall_s": job.elapsed_s, "log_tail": job.tail()})
            print(f"[driver] FAILED {tag} ({job.status}); log {work / (tag + '.log')}\n{job.tail()}", flush=True)
        doc["total_wall_s"] = time.monotonic() - t_all
        write_json(out, doc)  # after every run: partial results survive
    write_json(out, doc)
    plot(doc, out.with_suffix(".png"))
    print(f"[driver] wrote {out} and its PNG ({len(doc['runs'])} runs, {len(doc['skipped'])} skipped, "
          f"{len(doc['failed'])} failed)", flush=True)


# ------------------------------------------------------------------ the plot
# colour family = implementation (zerompi blues, torch oranges, DeepSpeed greens), darker = higher stage
COLORS = {"zerompi-0": "#c6dbef", "ddp": "#fdd0a2", "zerompi-1": "#6baed6", "torch-zero": "#fd8d3c",
          "deepspeed-1": "#a1d99b", "zerompi-2": "#2171b5", "deepspeed-2": "#41ab5d", "zerompi-3": "#08306b",
          "fsdp2": "#a63603", "deepspeed-3": "#00441b", "zerompi-0-bf16": "#dadaeb", "zerompi-1-bf16": "#9e9ac8",
          "zerompi-2-bf16": "#6a51a3", "zerompi-3-bf16": "#3f007d"}


def plot(doc: dict, png) -> None:
    """Columns: models. Rows: median step time (whiskers: min-max of the timed steps; white
    dot: CPU seconds per step, mean over ranks) and peak RSS per rank during the steps (the
    faded part: the runtime before the model; black dot: the whole process's peak; red dash:
    runtime + the ZeRO formula's model states; dotted: 16*Psi/N). Runs grouped by N, inside
    a group ordered by ZeRO stage."""
    from matplotlib.patches import Patch

    plt = pyplot()
    runs = doc["runs"]
    models = list(dict.fromkeys(r["model"] for r in runs))
    stage = lambda s: parse_system(s)[1] or 0  # noqa: E731  (ddp, torch-zero: stage 0 and 1 alike)
    systems = sorted({r["system"] for r in runs}, key=lambda s: (stage(s), list(COLORS).index(s) if s in COLORS else 99))
    width = 0.84 / max(1, len(systems))
    fig, axes = plt.subplots(2, max(1, len(models)), figsize=(max(8.0, 8.0 * len(models)), 9.0), squeeze=False)
    for c, model in enumerate(models):
        mruns = [r for r in runs if r["model"] == model]
        ns = sorted({r["n"] for r in mruns})
        ax_t, ax_m = axes[0][c], axes[1][c]
        for j, s in enumerate(systems):
            for k, n in enumerate(ns):
                hit = [r for r in mruns if (r["system"], r["n"]) == (s, n)]
                if not hit:
                    continue
                r, x = hit[0], k + (j - (len(systems) - 1) / 2) * width
                style = dict(color=COLORS.get(s, "grey"), edgecolor="black", linewidth=0.4, zorder=2)
                med = r["step_time_s_median"]
                ax_t.bar(x, med, width, **style)
                ax_t.errorbar(x, med, yerr=[[med - r["step_time_s_min"]], [r["step_time_s_max"] - med]],
                              color="black", linewidth=0.7, capsize=1.5, zorder=3)
                ax_t.plot(x, r.get("step_cpu_s_median_mean_rank", med), "o", mfc="white", mec="black", ms=3.5, zorder=4)
                peak = r.get("peak_rss_steps_bytes_max_rank") or r["peak_rss_process_bytes_max_rank"]
                base = max(rk.get("rss_runtime", 0) for rk in r["ranks"])
                ax_m.bar(x, peak / GiB, width, **style)
                ax_m.bar(x, min(base, peak) / GiB, width, color="white", alpha=0.45, linewidth=0, zorder=2.5)
                ax_m.plot(x, r["peak_rss_process_bytes_max_rank"] / GiB, "o", color="black", ms=3, zorder=4)
                ax_m.hlines((base + r["expected_model_states_bytes_per_rank"]) / GiB, x - width / 2, x + width / 2,
                            color="red", linewidth=1.5, zorder=4)
                ax_m.hlines(16 * r["params"] / n / GiB, k - 0.45, k + 0.45, color="black", linestyles=":", zorder=4)
        for ax in (ax_t, ax_m):
            ax.set_xticks(range(len(ns)), [f"N={n}" + (" (oversub.)" if n in doc.get("oversubscribed_n", []) else "")
                                           for n in ns])
            ax.grid(axis="y", alpha=0.3)
        ax_t.set_title(f"{model} ({mruns[0]['params'] / 1e6:.1f}M params, {mruns[0]['micro_batch']}x"
                       f"{mruns[0]['seq_len']} tokens/rank)")
        ax_t.set_ylabel("median step time [s] (max over ranks)")
        ax_m.set_ylabel("peak RSS per rank [GiB] (max over ranks)")
    axes[0][0].legend(handles=[Patch(facecolor=COLORS.get(s, "grey"), edgecolor="black", label=s) for s in systems],
                      loc="upper left", ncol=2, fontsize=7)
    m = doc.get("machine", {})
    save_figure(fig, png, f"Data parallel on CPU, AdamW, fp32 unless '-bf16': zerompi (MPI) vs torch and DeepSpeed "
                          f"(gloo); {m.get('cpu_model', '?')}, {m.get('cores', '?')} cores, "
                          f"{(m.get('ram_bytes') or 0) / GiB:.0f} GiB RAM")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true", help="one run on the MPI ranks (the driver starts it)")
    ap.add_argument("--system", default="zerompi-2", help=f"worker: one of {SYSTEMS + OPTIONAL_SYSTEMS}")
    ap.add_argument("--model", default="gpt-20m", help="worker: a zerompi.models.gpt preset")
    ap.add_argument("--systems", nargs="+", default=list(SYSTEMS))
    ap.add_argument("--models", nargs="+", default=["gpt-20m", "gpt-200m"])
    ap.add_argument("--nranks", nargs="+", type=int, default=[2, 4])
    ap.add_argument("--micro-batch", type=int, default=0, help="sequences per rank (0: per-model default)")
    ap.add_argument("--seq-len", type=int, default=0, help="tokens per sequence (0: per-model default)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5, help="timed steps")
    ap.add_argument("--steps-large", type=int, default=3, help="driver: timed steps for models of >= 100M parameters")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--bucket-size", type=int, default=0, help="zerompi bucket_size (0: engine default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mem-limit-gib", type=float, default=20.0,
                    help="driver: skip runs predicted to need more RAM (all ranks)")
    ap.add_argument("--run-timeout", type=float, default=3600.0, help="driver: seconds per run")
    ap.add_argument("--wait-quiet", type=float, default=1.0,
                    help="driver: before each run wait until at most this fraction of the machine is busy (1: no wait)")
    ap.add_argument("--wait-quiet-max", type=float, default=600.0, help="driver: longest such wait, s")
    ap.add_argument("--work-dir", default=None, help="driver: per-run JSON and logs (default: a temp dir)")
    ap.add_argument("--out", help="JSON output (worker: one run; driver: merged, its PNG beside it)")
    ap.add_argument("--replot", metavar="JSON", help="redraw the PNG of a driver's JSON (next to it)")
    args = ap.parse_args(argv)
    if args.replot:
        plot(json.loads(Path(args.replot).read_text()), Path(args.replot).with_suffix(".png"))
    elif not args.worker:
        args.out = args.out or str(result_path("dp"))
        driver(args)
    else:
        parse_system(args.system)
        worker(args)


if __name__ == "__main__":
    main()
