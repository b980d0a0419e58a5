"""One-GPU end to end (issue 12): the reference GPT in bf16, zerompi stages 0-3 at N = 1
against the same model in plain torch (fp32 parameters, bf16 autocast, AdamW(fused=True))
with the same micro-batch, in one run; tokens/s, their ratio, MFU, peak memory, and a
profile of one step (benchmarks/step_profile.py: the device's and the host's time, for plain
torch and the profiled stages) as tables.

    python benchmarks/bench_gpu_e2e.py --preset gpt-1b --micro 8 --seq 1024 \
        --peak-flops 989e12 --out benchmarks/results/gpu_e2e.json

MFU = tokens/s x flops per token / peak, flops per token = 6 N + 12 L C T (GPT's
flops_per_token at the measured sequence length; N non-embedding parameters; the
activation recomputation of checkpointing is not counted). `--device cpu --preset tiny`
runs the same code on the CPU (a smoke test of the script, not a measurement).

`--backend auto|nccl|mpi` is the engines' comm.backend (at N = 1 neither moves data):
`mpi` when NCCL does not load, so an NCCL problem costs the NCCL numbers, not the run.
A stage that fails records its error and the others still run; the JSON is rewritten
after every stage, and every engine is freed (gc, the CUDA cache emptied) before the
next one is built. `--train-steps K` adds a short run on the built-in corpus (real
text, so the loss can fall; random tokens cannot) with its losses; `--offload` adds
stage 2 with the optimizer offloaded to the host, for its peak GPU memory. Exit 1
when a part failed or the corpus run's loss did not fall.
Run on one H100 (benchmarks/results/gpu/); the host-side profile (step_profile.py) not yet.
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import traceback
from pathlib import Path

import torch

from bench_env import machine_info  # first: puts this checkout's zerompi on sys.path
import zerompi  # noqa: E402
from zerompi.models.gpt import GPT, PRESETS, count_params  # noqa: E402
from step_profile import profile_step, sync  # noqa: E402


def batches(cfg, micro: int, seq: int, dev, n: int, corpus=None):
    """Random tokens, or windows of `corpus` (a 1-D int tensor) when given."""
    g = torch.Generator().manual_seed(0)
    for _ in range(n):
        if corpus is None:
            x = torch.randint(0, cfg.vocab_size, (micro, seq + 1), generator=g)
        else:
            starts = torch.randint(0, len(corpus) - seq - 1, (micro,), generator=g)
            x = torch.stack([corpus[i:i + seq + 1] for i in starts.tolist()])
        yield x[:, :-1].to(dev), x[:, 1:].to(dev)


def load_corpus(max_bytes: int = 4 << 20) -> torch.Tensor:
    import numpy as np

    from zerompi.data import default_corpus

    return torch.from_numpy(np.fromfile(default_corpus(max_bytes=max_bytes), dtype=np.uint16).astype(np.int64))


def release(dev: torch.device) -> None:
    """Free what the last engine held before the next one is built: its reference
    cycles, and the blocks torch's caching allocator keeps (else the next stage's peak
    memory and free memory include them)."""
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)


def guarded(what: str, fn) -> dict:
    """fn()'s record, or {"error": ...} when it raises: one failing part (NCCL, memory)
    costs its own numbers only."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        print(f"bench_gpu_e2e: {what} failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return {"error": f"{type(e).__name__}: {e}"}


def profiled(step, cfg, a, dev) -> dict:
    """step_profile.profile_step of `step` on one fresh batch of the run's shape."""
    return profile_step(step, next(batches(cfg, a.micro, a.seq, dev, 1)), dev)


def run_torch(cfg, a, dev, profile: bool = False) -> dict:
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
    rec = timed(step, cfg, a, dev)
    if profile:
        rec["profile"] = profiled(step, cfg, a, dev)
    return rec


def engine_config(a, stage: int, offload: bool = False, lr: float = 1e-4, slots: int | None = None) -> dict:
    out = {"stage": stage, "precision": "bf16", "gradient_clipping": 1.0,
           "optimizer": {"lr": lr, "betas": [0.9, 0.95], "weight_decay": 0.1},
           "comm": {"backend": a.backend}, "offload_optimizer": "cpu" if offload else "none"}
    if slots is not None:
        out["bucket_count"] = slots
    return out


def run_zerompi(cfg, a, dev, stage: int, profile: bool, offload: bool = False, slots: int | None = None) -> dict:
    torch.manual_seed(0)
    model = GPT(cfg).to(dev)
    engine = zerompi.initialize(model, engine_config(a, stage, offload, slots=slots))

    def step(x, y):
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        return loss
    rec = timed(step, cfg, a, dev)
    rec["optimizer"] = type(engine.optimizer).__name__
    rec["backend"] = type(engine.comm).__name__
    if profile:
        rec["profile"] = profiled(step, cfg, a, dev)
    del engine, model
    return rec


def train_run(cfg, a, dev, corpus: torch.Tensor) -> dict:
    """zerompi stage 2 on the corpus for a.train_steps steps: the loss must fall."""
    torch.manual_seed(0)
    model = GPT(cfg).to(dev)
    engine = zerompi.initialize(model, engine_config(a, 2, lr=1e-3))
    losses = []
    t0 = time.perf_counter()
    for x, y in batches(cfg, a.micro, a.seq, dev, a.train_steps, corpus):
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach())
    losses = [float(v) for v in losses]  # one read of the device, after the run
    k = max(1, len(losses) // 4)
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    return {"stage": 2, "steps": len(losses), "seconds": time.perf_counter() - t0, "losses": losses,
            "first_quarter_mean": first, "last_quarter_mean": last, "loss_fell": last < 0.8 * first,
            "backend": type(engine.comm).__name__}


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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="gpt-1b", choices=sorted(PRESETS))
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--stages", default="0,1,2,3", help='comma-separated, or "none"')
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--peak-flops", type=float, default=0.0, help="per device, dense bf16")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--backend", default="auto", choices=["auto", "nccl", "mpi"], help="zero.comm.backend")
    ap.add_argument("--profile-stages", default="3", help='profile one step of each of these stages ("none")')
    ap.add_argument("--train-steps", type=int, default=0, help="a stage-2 run on the built-in corpus")
    ap.add_argument("--offload", action="store_true", help="also stage 2 with offload_optimizer = cpu")
    ap.add_argument("--stage3-slots", type=int, default=None, metavar="K",
                    help="also stage 3 with bucket_count K (profiled if stage 3 is): the reducer waits on "
                         "the host for its oldest bucket once all slots are in flight, so this shows "
                         "what that wait costs")
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
              "micro": a.micro, "seq": a.seq, "device": str(dev), "backend": a.backend}
    if dev.type == "cuda":
        result["gpu"] = torch.cuda.get_device_name(dev)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def record(key: str, rec: dict) -> None:
        plain = result.get("torch_plain", {})
        if "tokens_per_s" in rec and "tokens_per_s" in plain:
            rec["tokens_ratio_vs_torch"] = rec["tokens_per_s"] / plain["tokens_per_s"]
        result[key] = rec
        out.write_text(json.dumps(result, indent=1))  # as it goes: a cut-off run keeps what it has
        release(dev)
        if "error" in rec:
            return
        print(f"{key}: {rec['tokens_per_s']:.0f} tok/s"
              + (f", {rec['tokens_ratio_vs_torch']:.3f}x torch" if "tokens_ratio_vs_torch" in rec else "")
              + (f", MFU {rec['mfu']:.1%}" if rec.get("mfu") else "")
              + (f", device busy {rec['profile']['device_busy']:.0%} of a profiled step"
                 if rec.get("profile", {}).get("device_busy") is not None else ""), flush=True)

    profiled = [] if a.profile_stages == "none" else [int(s) for s in a.profile_stages.split(",")]
    record("torch_plain", guarded("plain torch", lambda: run_torch(cfg, a, dev, bool(profiled))))
    for s in [] if a.stages == "none" else map(int, a.stages.split(",")):
        record(f"stage{s}", guarded(f"stage {s}", lambda: run_zerompi(cfg, a, dev, s, s in profiled)))
    if a.stage3_slots is not None:
        record(f"stage3_slots{a.stage3_slots}", guarded("stage 3 slots", lambda: run_zerompi(
            cfg, a, dev, 3, 3 in profiled, slots=a.stage3_slots)))
    if a.offload:
        record("stage2_offload", guarded("stage 2 offload", lambda: run_zerompi(cfg, a, dev, 2, False, True)))
    if a.train_steps:
        rec = guarded("corpus run", lambda: train_run(cfg, a, dev, load_corpus()))
        result["train"] = rec
        out.write_text(json.dumps(result, indent=1))
        release(dev)
        if "error" not in rec:
            print(f"train: loss {rec['first_quarter_mean']:.3f} -> {rec['last_quarter_mean']:.3f} "
                  f"over {rec['steps']} steps ({'fell' if rec['loss_fell'] else 'DID NOT FALL'})", flush=True)
    failed = [k for k, v in result.items() if isinstance(v, dict) and "error" in v]
    fell = result.get("train", {}).get("loss_fell", True)  # a run that does not learn fails
    return 1 if failed or not fell else 0


if __name__ == "__main__":
    sys.exit(main())
