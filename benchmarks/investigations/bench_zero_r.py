#!/usr/bin/env python
"""ZeRO-R activation checkpoints with tensor parallelism: memory and Pa's traffic.

    python benchmarks/investigations/bench_zero_r.py \\
        --out benchmarks/investigations/results/zero_r_cpu.json \\
        --png benchmarks/investigations/results/zero_r_cpu.png

For the GPT below (4 blocks, width 512, 16 x 256 tokens per rank and micro-step), one
job (launch.py) per configuration: tp = 1 (1 rank) and tp = 2 (2 ranks, dp = 1), activation
checkpointing off | plain | partition (Pa) | partition + cpu_offload + contiguous, ZeRO
stage 2, fp32. Per configuration (rank 0; tp ranks are symmetric):
  - memory_report()'s activation_ckpt_device / _host (bytes set aside for kept inputs);
  - measured: the step's peak RSS above the RSS before it (VmHWM reset before the step),
    i.e. what forward + backward allocate on top of the model states;
  - traffic on the tp communicator per step: the tp layers' all-reduces and Pa's
    all-gathers, in the Communicator's elements (all_reduce n counts 2n, all_gather its
    output), and their ratio (the paper: Pa adds < 10% of the tp all-reduce volume);
  - median step time over the timed steps.
On a CPU-only machine "device" and "host" are the same memory: offload moves the kept
inputs into the host arena (device bytes 0), it cannot lower RSS here.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # benchmarks/: this study sits one folder down
from bench_env import current_rss, machine_info, reset_hwm, software_info, vm_hwm  # noqa: E402
from launch import launch  # noqa: E402

MODES = {"off": None, "plain": {"enabled": True},
         "partition": {"enabled": True, "partition": True},
         "offload": {"enabled": True, "partition": True, "cpu_offload": True, "contiguous": True}}
SHAPE = dict(vocab_size=256, block_size=256, n_layer=4, n_head=8, n_embd=512)
MICRO, SEQ = 16, 256


def worker(a) -> None:
    import torch

    import zerompi
    from zerompi.models.gpt import GPT, GPTConfig
    from zerompi.parallel.parallelize import parallelize
    from zerompi.parallel import ParallelDims

    torch.set_num_threads(1)
    dims = ParallelDims.create(tp_size=a.tp)
    torch.manual_seed(0)
    model = GPT(GPTConfig(**SHAPE))
    if a.tp > 1:
        model = parallelize(model, dims.tp)
    cfg = {"stage": 2, "tensor_parallel_size": a.tp, "optimizer": {"lr": 1e-4}}
    if MODES[a.mode]:
        cfg["activation_checkpointing"] = MODES[a.mode]
    engine = zerompi.initialize(model, cfg, dims=dims)
    g = torch.Generator().manual_seed(1 + dims.dp_rank)
    times, peaks = [], []
    for step in range(a.steps + 1):
        x = torch.randint(0, SHAPE["vocab_size"], (MICRO, SEQ), generator=g)
        dims.world.barrier()
        if step == 1:  # after the warm-up step: count one step's tp traffic
            dims.tp.reset_stats()
            if engine.activations is not None:
                engine.activations.reset_gather_stats()
        base = current_rss()
        hwm_ok = reset_hwm()
        t0 = time.perf_counter()
        _, loss = engine(x, torch.roll(x, -1, 1))
        engine.backward(loss)
        engine.step()
        dt = time.perf_counter() - t0
        if step == 1:
            tp_stats = dims.tp.stats()
            act = engine.activations.stats() if engine.activations is not None else {}
        if step >= 1:
            times.append(dt)
            peaks.append((vm_hwm() or 0) - base if hwm_ok else None)
    rep = engine.memory_report()
    if dims.rank == 0:
        ar = tp_stats.get("all_reduce", {}).get("elements", 0)
        ag = act.get("gather_elements", 0)
        with open(a.out, "w") as f:
            json.dump({"tp": a.tp, "mode": a.mode, "world": dims.world.size,
                       "activation_ckpt_device": rep["activation_ckpt_device"],
                       "activation_ckpt_host": rep["activation_ckpt_host"],
                       "step_peak_rss_above_start": max(p for p in peaks if p is not None) if any(peaks) else None,
                       "tp_all_reduce_elements": ar, "pa_all_gather_elements": ag,
                       "pa_over_tp_all_reduce": (ag / ar) if ar else None,
                       "tp_stats": tp_stats, "activations": act,
                       "step_s_median": statistics.median(times), "step_s": times,
                       "model_states": rep["model_states"]}, f)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--png", default=None)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--mode", default="off")
    a = ap.parse_args()
    if a.worker:
        return worker(a)
    runs, tmp = [], tempfile.mkdtemp(prefix="zero_r_")
    load0 = os.getloadavg()
    for tp in (1, 2):
        for mode in MODES:
            if tp == 1 and mode == "offload":
                pass  # still measured: offload without partition at tp 1
            out = os.path.join(tmp, f"tp{tp}-{mode}.json")
            job = launch(tp, [HERE / "bench_zero_r.py", "--worker", "--out", out, "--tp", tp,
                              "--mode", mode, "--steps", a.steps], timeout=600)
            if not job.ok:
                sys.exit(f"failed ({job.status}): {job.command_line}\n{job.tail(6000)}")
            r = json.load(open(out))
            runs.append(r)
            print(f"tp {tp} {mode:9s} ckpt device {r['activation_ckpt_device'] / 2**20:7.2f} MiB "
                  f"host {r['activation_ckpt_host'] / 2**20:7.2f} MiB  step peak above start "
                  f"{(r['step_peak_rss_above_start'] or 0) / 2**20:7.1f} MiB  Pa/tp-allreduce "
                  f"{r['pa_over_tp_all_reduce'] if r['pa_over_tp_all_reduce'] is not None else '-'}  "
                  f"{r['step_s_median']:.2f} s", flush=True)
    res = {"benchmark": "bench_zero_r", "date": time.strftime("%Y-%m-%d %H:%M"),
           "machine": machine_info(), "software": software_info(),
           "loadavg_start": load0, "loadavg_end": os.getloadavg(),
           "model": SHAPE, "micro_batch": MICRO, "seq": SEQ, "stage": 2, "precision": "fp32", "runs": runs}
    Path(a.out).write_text(json.dumps(res, indent=1))
    if a.png:
        plot(res, a.png)


def plot(res: dict, png: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    labels = [f"tp{r['tp']}\n{r['mode']}" for r in res["runs"]]
    xs = range(len(labels))
    dev = [r["activation_ckpt_device"] / 2**20 for r in res["runs"]]
    host = [r["activation_ckpt_host"] / 2**20 for r in res["runs"]]
    ax1.bar(xs, dev, label="kept on device (memory_report)")
    ax1.bar(xs, host, bottom=dev, label="kept on host (memory_report)")
    ax1.plot(xs, [(r["step_peak_rss_above_start"] or 0) / 2**20 for r in res["runs"]], "ko",
             label="measured: step peak RSS above start")
    ax1.set_xticks(list(xs), labels, fontsize=7)
    ax1.set_ylabel("MiB per rank")
    ax1.legend(fontsize=7)
    ax1.set_title("activation checkpoints per rank", fontsize=9)
    pa = [(r["pa_over_tp_all_reduce"] or 0) * 100 for r in res["runs"]]
    ax2.bar(xs, pa)
    ax2.axhline(10, color="r", ls="--", label="10% (paper)")
    ax2.set_xticks(list(xs), labels, fontsize=7)
    ax2.set_ylabel("Pa all-gather / tp all-reduce volume (%)")
    ax2.legend(fontsize=7)
    m = res["machine"]
    fig.suptitle(f"ZeRO-R on {m.get('node', '?')} ({m.get('cpu_model', '?')}, {m.get('cores')} cores), GPT {res['model']['n_layer']}x"
                 f"{res['model']['n_embd']}, {res['micro_batch']}x{res['seq']} tokens, stage 2 fp32", fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


if __name__ == "__main__":
    main()
