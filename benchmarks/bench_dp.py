#!/usr/bin/env python
"""Data-parallel CPU benchmark: zerompi stages 0-3 vs torch DDP, ZeroRedundancyOptimizer,
FSDP2 and DeepSpeed ZeRO.

The driver loops systems x models x N x malloc settings, one mpiexec job of this file's
--worker mode each (so peak RSS belongs to one system), merges the per-run JSON into one
file and draws the PNG next to it; --replot redraws it:

    python benchmarks/bench_dp.py --out benchmarks/results/dp_vm-epyc_202611.json
    python benchmarks/bench_dp.py --replot benchmarks/results/dp_vm-epyc_202611.json
    mpiexec -n 2 python -m mpi4py benchmarks/bench_dp.py --worker --system zerompi-3 --out r.json

Systems: zerompi-0/1/2/3 (fp32; a "-bf16" suffix runs bf16; zerompi-3 builds the model
under zerompi.Init), ddp (DistributedDataParallel), torch-zero (ZeroRedundancyOptimizer(AdamW)
over DDP), fsdp2 (torch.distributed.fsdp.fully_shard per block + root), deepspeed-1/2/3
(DeepSpeed ZeRO on its CPU accelerator; stage 3 builds under deepspeed.zero.Init); the torch
and DeepSpeed systems use gloo. Every system trains the same GPT from the same initial
weights on the same per-rank token batches with the same AdamW hyper-parameters. See
benchmarks/README.md for what is measured and the caveats.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

from harness import (DEFAULT_SHAPES, GiB, MALLOC_ENVS, RANK_ENV, current_rss, peak_rss_process, quiet_barrier,
                     reset_hwm, result_path, vm_hwm)
from dp_systems import OPTIONAL_SYSTEMS, SYSTEMS, build_system, expected_model_state_bytes, parse_system
from dp_driver import driver, plot


def worker(args) -> None:
    for k, v in RANK_ENV.items():
        os.environ.setdefault(k, v)
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    rss_start = current_rss()
    load_start = os.getloadavg()  # other work on the machine skews the timings
    import torch

    torch.set_num_threads(args.threads)
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
        "threads_per_rank": args.threads, "oversubscribed": world * args.threads > ncores,
        "malloc": args.malloc_label,
        "malloc_env": {k: os.environ[k] for k in ("MALLOC_MMAP_THRESHOLD_",) if k in os.environ},
        "optimizer": {"name": "AdamW", "lr": args.lr, "betas": [0.9, 0.95], "eps": 1e-8,
                      "weight_decay": args.weight_decay, "torch_impl": args.torch_adamw},
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
    print(f"[bench_dp] {args.system:15s} {args.model:9s} N={world} malloc={args.malloc_label}: "
          f"median step {med:.3f}s (cpu {res['step_cpu_s_median_mean_rank']:.3f}s/rank), "
          f"{res['tokens_per_s']:.0f} tok/s, "
          f"peak RSS/rank {res['peak_rss_process_bytes_max_rank'] / GiB:.2f} GiB "
          f"(steps {((res['peak_rss_steps_bytes_max_rank'] or 0) / GiB):.2f} GiB)", flush=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true", help="one run on the MPI ranks (the driver starts it)")
    ap.add_argument("--system", default="zerompi-2", help=f"worker: one of {SYSTEMS + OPTIONAL_SYSTEMS}")
    ap.add_argument("--model", default="gpt-20m", help="worker: a zerompi.models.gpt preset")
    ap.add_argument("--systems", nargs="+", default=list(SYSTEMS))
    ap.add_argument("--models", nargs="+", default=["gpt-20m", "gpt-200m"])
    ap.add_argument("--nranks", nargs="+", type=int, default=[2, 4])
    ap.add_argument("--malloc", nargs="+", default=["default"], choices=list(MALLOC_ENVS),
                    help="driver: glibc malloc settings to run every system under "
                         "(add mmap128k for MALLOC_MMAP_THRESHOLD_=131072 runs)")
    ap.add_argument("--malloc-label", default=None, help="worker: recorded malloc setting name")
    ap.add_argument("--micro-batch", type=int, default=0, help="sequences per rank (0: per-model default)")
    ap.add_argument("--seq-len", type=int, default=0, help="tokens per sequence (0: per-model default)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5, help="timed steps")
    ap.add_argument("--steps-large", type=int, default=3, help="driver: timed steps for large models")
    ap.add_argument("--large-params", type=int, default=100_000_000, help="driver: 'large' threshold")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--torch-adamw", default="default", choices=["default", "for-loop", "fused"],
                    help="torch.optim.AdamW implementation for ddp/torch-zero")
    ap.add_argument("--ddp-bucket-mb", type=float, default=25.0)
    ap.add_argument("--ddp-grad-view", type=int, default=1, choices=[0, 1],
                    help="DDP gradient_as_bucket_view (1: grads live in the buckets, 16*Psi)")
    ap.add_argument("--bucket-size", type=int, default=0, help="zerompi bucket_size (0: engine default)")
    ap.add_argument("--ds-zero", default="",
                    help='DeepSpeed: JSON merged into zero_optimization, e.g. '
                         '\'{"stage3_max_reuse_distance": 0}\' (default: DeepSpeed\'s defaults)')
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
        args.malloc_label = args.malloc_label or (
            "mmap128k" if os.environ.get("MALLOC_MMAP_THRESHOLD_") else "default")
        worker(args)


if __name__ == "__main__":
    main()
