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
import plot_dp


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
        argv = [script, "--system", s, "--model", m, "--micro-batch", bsz, "--seq-len", seq,
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
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, indent=1))  # after every run: partial results survive
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    print(f"[driver] wrote {out} ({len(doc['runs'])} runs, {len(doc['skipped'])} skipped, "
          f"{len(doc['failed'])} failed) in {doc.get('total_wall_s', 0):.0f}s", flush=True)
    if args.png:
        plot_dp.plot(doc, args.png)
        print(f"[driver] wrote {args.png}", flush=True)


def shape_of(args, model: str) -> tuple[int, int]:
    from zerompi.models.gpt import PRESETS

    bsz, seq = DEFAULT_SHAPES.get(model, (1, PRESETS[model].block_size))
    return args.micro_batch or bsz, args.seq_len or seq

