"""Driver of the data-parallel benchmark: predicts memory, runs one mpiexec per
(system, model, N, malloc), merges the per-run JSON and draws the plot (see bench_dp.py).
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from harness import (
    pyplot,
    write_json,
    launch,
    wait_quiet,
    DEFAULT_SHAPES,
    GiB,
    HERE,
    MALLOC_ENVS,
    RANK_ENV,
    machine_info,
    mem_info,
    software_info,
)
from dp_systems import _zerompi_default_bucket, expected_model_state_bytes, parse_system


def predict_rank_bytes(system: str, model: str, n: int, bsz: int, seq: int,
                       bucket_size: int, ddp_grad_view: bool) -> int:
    """Rough per-rank peak: runtime + model states + comm buffers + activations. Used
    only to skip runs that could exhaust RAM; calibrated on this machine's small runs."""
    from zerompi.models.gpt import PRESETS, count_params

    cfg = PRESETS[model]
    psi = count_params(cfg)
    kind, stage, prec = parse_system(system)
    runtime = int(0.6 * GiB)  # python + torch + MPI (+ gloo, deepspeed: ~0.25 GiB measured)
    states = expected_model_state_bytes(system, psi, n)
    block = 12 * cfg.n_embd * cfg.n_embd  # parameters of one transformer block
    bucket = 4 * min(bucket_size, psi)
    if kind == "zerompi" and stage == 3:
        # built partitioned, but with the default malloc the freed full temporaries of Init
        # stayed resident (up to ~4*Psi measured at 200M/N=4); gathered units on top
        states += 4 * psi
        extra = 2 * 2 * bucket + 3 * 2 * 4 * block
    elif kind == "zerompi":
        # set-up transient: the model's own fp32 tensors plus the packed flat copy
        states = max(states, 8 * psi)
        extra = 2 * 2 * bucket  # two buckets + their receive scratch
    elif kind == "fsdp2":
        # every rank builds the full model before sharding; unsharded blocks while stepping
        states = max(states, 4 * psi + 4 * psi // n)
        extra = 3 * 2 * 4 * block
    elif kind == "deepspeed":
        # + its fp32 partition copy (4*Psi/N, also in fp32) and reduce bucket(s). Stage 3:
        # with the default max_reuse_distance/max_live_parameters (1e9) gathered params
        # stay alive from forward to backward; measured at 200M/N=2: ~3.2*4*Psi on top
        states += 4 * psi // n
        extra = 2 * bucket + (int(3.5 * 4 * psi) if stage == 3 else 2 * bucket)
    else:
        extra = 0 if ddp_grad_view else 4 * psi  # DDP's buckets beside param.grad
    # saved activations (fp32): ~20 floats per token per layer and channel, logits x3
    act = bsz * seq * (cfg.n_layer * cfg.n_embd * 20 + cfg.vocab_size * 3) * 4
    return runtime + states + extra + act


def driver(args) -> None:
    import mpi4py

    # The driver only reads the MPI library version; MPI_Init here would make it a
    # singleton MPI process beside the jobs it launches.
    mpi4py.rc.initialize = mpi4py.rc.finalize = False
    from zerompi.models.gpt import PRESETS

    models, nranks, systems, mallocs = args.models, args.nranks, args.systems, args.malloc
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench_dp_"))
    work.mkdir(parents=True, exist_ok=True)
    out = Path(args.out)
    ncores = os.cpu_count() or 1
    doc = {
        "benchmark": "bench_dp: step time and per-rank RSS, data parallel on CPU",
        "machine": machine_info(), "software": software_info(),
        "loadavg_at_start": os.getloadavg(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "parameters": {"models": models, "nranks": nranks, "systems": systems, "malloc": mallocs,
                       "warmup": args.warmup, "steps": args.steps,
                       "steps_large": args.steps_large, "large_params": args.large_params,
                       "shapes": {m: list(shape_of(args, m)) for m in models},
                       "threads_per_rank": args.threads, "lr": args.lr,
                       "weight_decay": args.weight_decay, "betas": [0.9, 0.95], "eps": 1e-8,
                       "torch_adamw": args.torch_adamw, "ddp_bucket_mb": args.ddp_bucket_mb,
                       "ddp_gradient_as_bucket_view": bool(args.ddp_grad_view),
                       "zerompi_bucket_size": args.bucket_size or {
                           str(n): _zerompi_default_bucket(n) for n in nranks},
                       "deepspeed": "fp32, torch AdamW (torch_adam), reduce/allgather buckets = "
                                    "zerompi_bucket_size, other ZeRO settings DeepSpeed's defaults; "
                                    "stage 3 built under deepspeed.zero.Init",
                       "ds_zero_overrides": json.loads(args.ds_zero or "{}"),
                       "fsdp2": "fully_shard per transformer block, then the root; fp32; "
                                "reshard_after_forward=True; built full on every rank, then sharded",
                       "mem_limit_gib": args.mem_limit_gib, "wait_quiet": args.wait_quiet,
                       "seed": args.seed,
                       "rank_env": RANK_ENV, "malloc_envs": {k: MALLOC_ENVS[k] for k in mallocs},
                       "timing": "per step: sleep-polling barrier, then fwd+bwd+optimizer step; "
                                 "max over ranks per step, median over timed steps"},
        "oversubscribed_n": [n for n in nranks if n * args.threads > ncores],
        "formulas": {"zerompi-0 / ddp": "16*Psi",
                     "zerompi-1 / torch-zero / deepspeed-1 (fp32)": "8*Psi + 8*Psi/N",
                     "zerompi-2 / deepspeed-2 (fp32)": "4*Psi + 12*Psi/N",
                     "zerompi-3 / fsdp2 / deepspeed-3": "16*Psi/N",
                     "zerompi-1 (bf16)": "4*Psi + 12*Psi/N", "zerompi-2 (bf16)": "2*Psi + 14*Psi/N"},
        "runs": [], "skipped": [], "failed": [],
    }
    script = HERE / "bench_dp.py"  # the worker entry point
    from zerompi.models.gpt import count_params

    # DeepSpeed is optional: without it its runs are recorded as skipped, with the reason
    ds_missing = None
    if any(parse_system(s)[0] == "deepspeed" for s in systems):
        import importlib.util

        if importlib.util.find_spec("deepspeed") is None:
            ds_missing = ("deepspeed is not installed (pip install einops hjson msgpack ninja "
                          "psutil && pip install --no-deps deepspeed==0.19.8; see benchmarks/README.md)")
    plan = [(m, n, s, mal) for m in models for n in nranks for mal in mallocs for s in systems]
    t_all = time.monotonic()
    for i, (m, n, s, mal) in enumerate(plan):
        bsz, seq = shape_of(args, m)
        tag = f"{s}__{m}__n{n}__{mal}"
        psi = count_params(PRESETS[m])
        steps = args.steps_large if psi >= args.large_params else args.steps
        _, stage, prec = parse_system(s)
        bucket = args.bucket_size or _zerompi_default_bucket(n, stage or 0, prec)
        pred = n * predict_rank_bytes(s, m, n, bsz, seq, bucket, bool(args.ddp_grad_view))
        avail = mem_info().get("MemAvailable", 0)
        entry = {"system": s, "model": m, "n": n, "malloc": mal,
                 "predicted_total_bytes": pred, "mem_available_bytes": avail}
        if ds_missing and parse_system(s)[0] == "deepspeed":
            entry["reason"] = ds_missing
            doc["skipped"].append(entry)
            print(f"[driver] skip {tag}: {ds_missing}", flush=True)
            continue
        if pred > args.mem_limit_gib * GiB:
            entry["reason"] = f"predicted {pred / GiB:.1f} GiB > limit {args.mem_limit_gib} GiB"
            doc["skipped"].append(entry)
            print(f"[driver] skip {tag}: {entry['reason']}", flush=True)
            continue
        if avail and pred > avail - GiB:
            entry["reason"] = (f"predicted {pred / GiB:.1f} GiB > available "
                               f"{avail / GiB:.1f} GiB - 1 GiB at launch")
            doc["skipped"].append(entry)
            print(f"[driver] skip {tag}: {entry['reason']}", flush=True)
            continue
        wait_quiet(args.wait_quiet, args.wait_quiet_max)  # the machine is shared: other work skews timings
        rfile = work / f"{tag}.json"
        argv = [script, "--worker", "--system", s, "--model", m, "--micro-batch", bsz, "--seq-len", seq,
                "--warmup", args.warmup, "--steps", steps, "--threads", args.threads,
                "--lr", args.lr, "--weight-decay", args.weight_decay,
                "--torch-adamw", args.torch_adamw, "--ddp-bucket-mb", args.ddp_bucket_mb,
                "--ddp-grad-view", args.ddp_grad_view, "--seed", args.seed,
                "--malloc-label", mal, "--out", rfile]
        if args.bucket_size:
            argv += ["--bucket-size", args.bucket_size]
        if args.ds_zero:
            argv += ["--ds-zero", args.ds_zero]
        print(f"[driver] ({i + 1}/{len(plan)}) {tag}: predicted {pred / GiB:.1f} GiB", flush=True)
        try:
            job = launch(n, argv, timeout=args.run_timeout, env=MALLOC_ENVS[mal],
                         log=work / f"{tag}.log")
        except KeyboardInterrupt:  # the job is killed; keep what finished
            print("[driver] interrupted; writing what finished", flush=True)
            break
        log, wall = job.output, job.elapsed_s
        if job.ok and rfile.exists():
            run = json.loads(rfile.read_text())
            run["wall_s"] = wall
            run["predicted_total_bytes"] = pred
            doc["runs"].append(run)
            sys.stdout.write("".join(l + "\n" for l in log.splitlines() if l.startswith("[bench_dp]")))
        else:
            entry.update(returncode=job.status, wall_s=wall, log_tail=job.tail())
            doc["failed"].append(entry)
            print(f"[driver] FAILED {tag} (rc={job.status}); log {work / (tag + '.log')}\n"
                  f"{log[-1500:]}", flush=True)
        doc["total_wall_s"] = time.monotonic() - t_all
        write_json(out, doc)  # after every run: partial results survive
    write_json(out, doc)
    print(f"[driver] wrote {out} ({len(doc['runs'])} runs, {len(doc['skipped'])} skipped, "
          f"{len(doc['failed'])} failed) in {doc.get('total_wall_s', 0):.0f}s", flush=True)
    plot(doc, out.with_suffix(".png"))
    print(f"[driver] wrote {out.with_suffix('.png')}", flush=True)


def shape_of(args, model: str) -> tuple[int, int]:
    from zerompi.models.gpt import PRESETS

    bsz, seq = DEFAULT_SHAPES.get(model, (1, PRESETS[model].block_size))
    return args.micro_batch or bsz, args.seq_len or seq


# ------------------------------------------------------------------ the plot
# Order = position inside an N group (by stage); colour family = implementation.
COLORS = {
    "zerompi-0": "#c6dbef", "ddp": "#fdd0a2",
    "zerompi-1": "#6baed6", "torch-zero": "#fd8d3c", "deepspeed-1": "#a1d99b",
    "zerompi-2": "#2171b5", "deepspeed-2": "#41ab5d",
    "zerompi-3": "#08306b", "fsdp2": "#a63603", "deepspeed-3": "#00441b",
    "zerompi-0-bf16": "#dadaeb", "zerompi-1-bf16": "#9e9ac8", "zerompi-2-bf16": "#6a51a3",
    "zerompi-3-bf16": "#3f007d",
}
STAGE = {"zerompi-0": 0, "ddp": 0, "zerompi-1": 1, "torch-zero": 1, "deepspeed-1": 1,
         "zerompi-2": 2, "deepspeed-2": 2, "zerompi-3": 3, "fsdp2": 3, "deepspeed-3": 3,
         "zerompi-0-bf16": 0, "zerompi-1-bf16": 1, "zerompi-2-bf16": 2, "zerompi-3-bf16": 3}
HATCH = {"default": "", "mmap128k": "//"}
GAP = 0.6  # extra space between stage groups, in bar widths


def _sys_order(systems):
    known = list(COLORS)
    return sorted(systems, key=lambda s: (STAGE.get(s, 9), known.index(s) if s in known else len(known)))


def _slots(series):
    """x offset (in bar widths, centred on 0) of each series, with a gap between stages."""
    pos, x, prev = [], 0.0, None
    for s, _ in series:
        st = STAGE.get(s, 9)
        if prev is not None and st != prev:
            x += GAP
        pos.append(x)
        x += 1.0
        prev = st
    mid = (pos[-1] if pos else 0.0) / 2
    return [p - mid for p in pos], (pos[-1] + 1.0 if pos else 1.0)


def plot(doc: dict, png) -> None:
    """Columns: models. Rows: median step time (whiskers: min-max of the timed steps; white
    dot: CPU seconds per step, mean over ranks) and peak RSS per rank (bars: peak during the
    training steps, the faded part is the runtime before the model; black dot: whole-process
    peak including set-up; red dash: runtime + the ZeRO formula's model-state bytes; dotted
    line across each N: stage 0's model states / N, 16*Psi/N, the stage-3 target).
    Within a panel runs are grouped by N. Inside each N, systems are ordered by ZeRO stage
    (0, 1, 2, then the shaded stage-3 group) and coloured by implementation: zerompi blues,
    torch oranges, DeepSpeed greens, darker = higher stage. Hatched bars ran with
    MALLOC_MMAP_THRESHOLD_=131072."""
    from matplotlib.patches import Patch

    plt = pyplot()

    runs = doc["runs"]
    models = [m for m in doc["parameters"]["models"] if any(r["model"] == m for r in runs)] \
        or sorted({r["model"] for r in runs})
    systems = _sys_order({r["system"] for r in runs})
    mallocs = [m for m in doc["parameters"].get("malloc", ["default"]) if any(r["malloc"] == m for r in runs)]
    series = [(s, mal) for s in systems for mal in mallocs]
    offs, span = _slots(series)
    width = 0.84 / max(1.0, span)
    ncol = max(1, len(models))
    fig, axes = plt.subplots(2, ncol, figsize=(max(8.0, 8.0 * ncol), 9.0), squeeze=False)
    for c, model in enumerate(models):
        mruns = [r for r in runs if r["model"] == model]
        ns = sorted({r["n"] for r in mruns})
        ax_t, ax_m = axes[0][c], axes[1][c]
        for k, n in enumerate(ns):
            s3 = [k + offs[j] * width for j, (s, _) in enumerate(series) if STAGE.get(s) == 3]
            if s3:  # shade the stage-3 comparison
                for ax in (ax_t, ax_m):
                    ax.axvspan(min(s3) - 0.6 * width, max(s3) + 0.6 * width, color="#eeeeee", zorder=0)
            nr = [r for r in mruns if r["n"] == n]
            if nr:  # the stage-3 target: stage 0's model states split N ways
                lo, hi = k + offs[0] * width - width / 2, k + offs[-1] * width + width / 2
                ax_m.hlines(16 * nr[0]["params"] / n / GiB, lo, hi, color="black",
                            linestyles=":", linewidth=1.2, zorder=4)
        for j, (s, mal) in enumerate(series):
            for k, n in enumerate(ns):
                hit = [r for r in mruns if r["system"] == s and r["malloc"] == mal and r["n"] == n]
                if not hit:
                    continue
                r = hit[0]
                x = k + offs[j] * width
                style = dict(color=COLORS.get(s, "grey"), hatch=HATCH.get(mal, ".."),
                             edgecolor="black", linewidth=0.4, zorder=2)
                med = r["step_time_s_median"]
                ax_t.bar(x, med, width, **style)
                ax_t.errorbar(x, med, yerr=[[med - r["step_time_s_min"]], [r["step_time_s_max"] - med]],
                              color="black", linewidth=0.7, capsize=1.5, zorder=3)
                cpu = r.get("step_cpu_s_median_mean_rank")
                if cpu is not None:
                    ax_t.plot(x, cpu, "o", mfc="white", mec="black", ms=3.5, mew=0.7, zorder=4)
                peak_steps = r.get("peak_rss_steps_bytes_max_rank") or r["peak_rss_process_bytes_max_rank"]
                base = max(rk.get("rss_runtime", 0) for rk in r["ranks"])
                ax_m.bar(x, peak_steps / GiB, width, **style)
                ax_m.bar(x, min(base, peak_steps) / GiB, width, color="white", alpha=0.45,
                         linewidth=0, zorder=2.5)
                ax_m.plot(x, r["peak_rss_process_bytes_max_rank"] / GiB, "o", color="black", ms=3, zorder=4)
                ax_m.hlines((base + r["expected_model_states_bytes_per_rank"]) / GiB,
                            x - width / 2, x + width / 2, color="red", linewidth=1.5, zorder=4)
        psi = mruns[0]["params"] if mruns else 0
        shape = f"{mruns[0]['micro_batch']}x{mruns[0]['seq_len']} tokens/rank" if mruns else ""
        over = [n for n in ns if any(r["n"] == n and r.get("oversubscribed") for r in mruns)]
        labels = [f"N={n}" + (" (oversub.)" if n in over else "") for n in ns]
        for ax in (ax_t, ax_m):
            ax.set_xticks(range(len(ns)))
            ax.set_xticklabels(labels)
            ax.grid(axis="y", alpha=0.3)
            ax.set_axisbelow(True)
        ax_t.set_title(f"{model} ({psi / 1e6:.1f}M params, {shape}); shaded: stage 3")
        ax_t.set_ylabel("median step time [s] (max over ranks)")
        ax_m.set_ylabel("peak RSS per rank [GiB] (max over ranks)")
    # systems legend: one column per ZeRO stage, headed by the stage
    blank = Patch(facecolor="none", edgecolor="none", label="")
    stages = sorted({STAGE.get(s, 9) for s in systems})
    cols = [[s for s in systems if STAGE.get(s, 9) == st] for st in stages]
    rows = max(len(c) for c in cols) + 1
    sys_handles = []
    for st, col in zip(stages, cols):
        head = Patch(facecolor="none", edgecolor="none", label=f"stage {st}" if st != 9 else "other")
        sys_handles += [head] + [Patch(facecolor=COLORS.get(s, "grey"), edgecolor="black", label=s)
                                 for s in col] + [blank] * (rows - 1 - len(col))
    marks = [Patch(facecolor="white", edgecolor="black", hatch=HATCH.get(m, ".."),
                   label=f"malloc: {m}") for m in mallocs if len(mallocs) > 1]
    marks += [
        plt.Line2D([], [], color="black", marker="o", mfc="white", ls="", ms=3.5,
                   label="CPU s/step (median, mean over ranks)"),
        plt.Line2D([], [], color="black", marker="o", ls="", ms=3, label="whole-process peak RSS"),
        plt.Line2D([], [], color="red", lw=1.5, label="runtime + formula model states"),
        plt.Line2D([], [], color="black", lw=1.2, ls=":", label="stage-0 model states / N (16Ψ/N)"),
        Patch(facecolor="#bbbbbb", edgecolor="none", label="faded: RSS before the model"),
    ]
    fig.legend(handles=sys_handles, loc="lower left", ncol=len(stages), fontsize=8,
               bbox_to_anchor=(0.01, 0.0), frameon=False)
    fig.legend(handles=marks, loc="lower right", ncol=2, fontsize=8, bbox_to_anchor=(0.99, 0.0),
               frameon=False)
    mach = doc.get("machine", {})
    over_n = doc.get("oversubscribed_n") or []
    title = (f"Data parallel on CPU, AdamW, fp32 unless '-bf16': zerompi (MPI) vs torch DDP / "
             f"ZeroRedundancyOptimizer / FSDP2 and DeepSpeed ZeRO (gloo)\n"
             f"machine: {mach.get('node', '?')}, {mach.get('cpu_model', '?')}, {mach.get('cores', '?')} cores, "
             f"{(mach.get('ram_bytes') or 0) / GiB:.0f} GiB RAM; "
             f"{doc['parameters'].get('threads_per_rank', 1)} thread/rank"
             + (f"; N={','.join(map(str, over_n))} oversubscribes the cores" if over_n else ""))
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.02 + 0.021 * max(rows, -(-len(marks) // 2)), 1, 0.95))
    fig.savefig(png, dpi=130)
    plt.close(fig)
