"""One-GPU end to end (issue 12): the reference GPT in bf16, zerompi stages 0-3 at N = 1
against the same model in plain torch (fp32 parameters, bf16 autocast, AdamW(fused=True))
with the same micro-batch, in one run; tokens/s, their ratio, MFU, peak memory, and a
profile of one zerompi step (top CUDA kernels by time) as a table.

    python benchmarks/bench_gpu_e2e.py --preset gpt-1b --micro 8 --seq 1024 \
        --peak-flops 989e12 --out benchmarks/results/gpu_e2e.json

MFU = tokens/s x flops per token / peak, flops per token = 6 N + 12 L C T (GPT's
flops_per_token at the measured sequence length; N non-embedding parameters; the
activation recomputation of checkpointing is not counted). `--device cpu --preset tiny`
runs the same code on the CPU (a smoke test of the script, not a measurement).
NOT YET RUN ON A GPU: written while no GPU was lent.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from bench_env import machine_info  # first: puts this checkout's zerompi on sys.path
import zerompi  # noqa: E402
from zerompi.models.gpt import GPT, PRESETS, count_params  # noqa: E402


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)  # benchmark timing only, never inside the engine


def batches(cfg, micro: int, seq: int, dev, n: int):
    g = torch.Generator().manual_seed(0)
    for _ in range(n):
        x = torch.randint(0, cfg.vocab_size, (micro, seq + 1), generator=g)
        yield x[:, :-1].to(dev), x[:, 1:].to(dev)


def run_torch(cfg, a, dev) -> dict:
    torch.manual_seed(0)
    model = GPT(cfg).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=dev.type == "cuda")

    def step(x, y):
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss
    return timed(step, cfg, a, dev)


def run_zerompi(cfg, a, dev, stage: int, profile: bool) -> dict:
    torch.manual_seed(0)
    model = GPT(cfg).to(dev)
    engine = zerompi.initialize(model, {"stage": stage, "precision": "bf16", "gradient_clipping": 1.0,
                                        "optimizer": {"lr": 1e-4, "betas": [0.9, 0.95],
                                                      "weight_decay": 0.1}})

    def step(x, y):
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        return loss
    rec = timed(step, cfg, a, dev)
    rec["optimizer"] = type(engine.optimizer).__name__
    rec["backend"] = type(engine.comm).__name__
    if profile:
        rec["profile"] = profile_step(step, cfg, a, dev)
    del engine, model
    return rec


def timed(step, cfg, a, dev) -> dict:
    data = batches(cfg, a.micro, a.seq, dev, a.warmup + a.steps)
    for _ in range(a.warmup):
        step(*next(data))
    sync(dev)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    t0 = time.perf_counter()
    for _ in range(a.steps):
        loss = step(*next(data))
    sync(dev)
    dt = (time.perf_counter() - t0) / a.steps
    tokens = a.micro * a.seq / dt
    fpt = flops_per_token(cfg, a.seq)
    out = {"step_s": dt, "tokens_per_s": tokens, "loss": float(loss.detach()), "flops_per_token": fpt,
           "mfu": tokens * fpt / a.peak_flops if a.peak_flops else None}
    if dev.type == "cuda":
        out["peak_memory_bytes"] = torch.cuda.max_memory_allocated(dev)
    return out


def flops_per_token(cfg, seq: int) -> int:
    return 6 * count_params(cfg, non_embedding=True) + 12 * cfg.n_layer * cfg.n_embd * seq


def profile_step(step, cfg, a, dev, top: int = 25) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    x, y = next(batches(cfg, a.micro, a.seq, dev, 1))
    with profile(activities=acts) as prof:
        step(x, y)
        sync(dev)
    key = "self_device_time_total" if dev.type == "cuda" else "self_cpu_time_total"
    rows = sorted(prof.key_averages(), key=lambda e: getattr(e, key, 0), reverse=True)[:top]
    return [{"name": e.key, "calls": e.count, "self_us": getattr(e, key, 0)} for e in rows]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="gpt-1b", choices=sorted(PRESETS))
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--stages", default="0,1,2,3")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--peak-flops", type=float, default=0.0, help="per device, dense bf16")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default="benchmarks/results/gpu_e2e.json")
    a = ap.parse_args(argv)
    dev = torch.device(a.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("bench_gpu_e2e: no CUDA device visible", file=sys.stderr)
        return 2
    zerompi.runtime.init()
    cfg = PRESETS[a.preset]
    if a.seq > cfg.block_size:
        ap.error(f"--seq {a.seq} > the preset's block_size {cfg.block_size}")
    result = {"machine": machine_info(), "torch": torch.__version__, "preset": a.preset,
              "micro": a.micro, "seq": a.seq, "device": str(dev)}
    if dev.type == "cuda":
        result["gpu"] = torch.cuda.get_device_name(dev)
    result["torch_plain"] = run_torch(cfg, a, dev)
    for s in map(int, a.stages.split(",")):
        rec = run_zerompi(cfg, a, dev, s, profile=s == 3)
        rec["tokens_ratio_vs_torch"] = rec["tokens_per_s"] / result["torch_plain"]["tokens_per_s"]
        result[f"stage{s}"] = rec
        print(f"stage {s}: {rec['tokens_per_s']:.0f} tok/s, {rec['tokens_ratio_vs_torch']:.3f}x torch"
              + (f", MFU {rec['mfu']:.1%}" if rec["mfu"] else ""), flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
