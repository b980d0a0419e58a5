"""The offloaded optimizer on one GPU: the step and its phases against what the
machine offers, the delayed update against the step without offload, and capacity.

    python benchmarks/bench_offload_gpu.py --preset gpt-1b --steps 3 --out PATH.json [--delayed] [--capacity]
    python benchmarks/bench_offload_gpu.py --device cpu --preset tiny --micro 2 --seq 32 --out x.json --delayed
        (the CPU: a check of the script, not a measurement)

Parts, each recorded as it finishes (the JSON is rewritten), a failing part records its
error and the others still run:
  machine   PCIe bytes/s host->device and device->host (1 GiB, cudaHostRegister'ed pages),
            the host's copy bytes/s (torch, all threads, 2 GiB read + written)
  offload   stage 2, bf16, offload_optimizer = cpu (staged pipeline): seconds per step
            (--steps after --warmup, no extra syncs), peak GPU memory over those steps, and
            one instrumented step: forward+backward (synchronised), then engine.step()'s
            phases (engine.offload_phases) with each phase's bytes/s next to the machine's
  plain     the same model and batch without offload
  delayed   (--delayed) gradient accumulation G chosen so that G micro-batches of
            forward+backward take at least the measured host update (the batch is
            micro x G x seq tokens), then plain and offload.delayed_update = true at it
  capacity  (--capacity) the largest GPT of LADDER whose engine builds and runs one step
            (micro 1, seq 512) with and without offload: from the largest a memory model
            predicts to fit, up while it fits, down while not; a size whose host memory
            need (16 bytes per parameter with the staging) exceeds 85% of MemAvailable is
            not tried (the machine could kill the run) and reported as limited by host
            memory; no probe starts after --capacity-budget seconds
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
import traceback
from pathlib import Path

from harness import machine_info, mem_info  # first: puts this checkout's zerompi on sys.path

import torch  # noqa: E402

import zerompi  # noqa: E402
from zerompi.models.gpt import PRESETS, count_params  # noqa: E402
from zerompi.models.gpt_config import GPTConfig  # noqa: E402
from e2e_systems import batches, new_model  # noqa: E402
from step_profile import release, sync  # noqa: E402

GB = 1e9
# GPT-3's shapes (byte-level vocabulary), for the capacity ladder beyond the presets
LADDER = {"gpt-1b": PRESETS["gpt-1b"],
          "gpt-2.7b": GPTConfig(vocab_size=256, block_size=1024, n_layer=32, n_head=32, n_embd=2560),
          "gpt-4b": GPTConfig(vocab_size=256, block_size=1024, n_layer=32, n_head=24, n_embd=3072),
          "gpt-6.7b": GPTConfig(vocab_size=256, block_size=1024, n_layer=32, n_head=32, n_embd=4096),
          "gpt-13b": GPTConfig(vocab_size=256, block_size=1024, n_layer=40, n_head=40, n_embd=5120),
          "gpt-20b": GPTConfig(vocab_size=256, block_size=1024, n_layer=44, n_head=48, n_embd=6144)}


def machine(dev) -> dict:
    out = {"host_copy_GBps": None}
    src = torch.ones(1 << (29 if dev.type == "cuda" else 25))  # 2 GiB (128 MiB on the CPU check)
    dst = torch.empty_like(src)
    dst.copy_(src)
    t0 = time.perf_counter()
    for _ in range(3):
        dst.copy_(src)
    out["host_copy_GBps"] = 3 * 2 * src.numel() * 4 / (time.perf_counter() - t0) / GB  # read + written
    out["host_threads"] = torch.get_num_threads()
    del src, dst
    if dev.type == "cuda":
        from zerompi.zero.pinned import host_zeros

        n = 1 << 30
        host, d = host_zeros(n, torch.uint8, pin=True), torch.empty(n, dtype=torch.uint8, device=dev)
        for name, fn in (("h2d_GBps", lambda: d.copy_(host, non_blocking=True)),
                         ("d2h_GBps", lambda: host.copy_(d, non_blocking=True))):
            fn()
            sync(dev)
            t0 = time.perf_counter()
            for _ in range(3):
                fn()
            sync(dev)
            out[name] = 3 * n / (time.perf_counter() - t0) / GB
        del host, d
    return out


THREADS = "auto"  # offload.threads of every offloaded run (--threads)


def config(offload: bool, delayed: bool = False, gas: int = 1) -> dict:
    cfg = {"stage": 2, "precision": "bf16", "gradient_clipping": 1.0, "gradient_accumulation_steps": gas,
           "optimizer": {"lr": 1e-4, "betas": [0.9, 0.95], "weight_decay": 0.1},
           "offload_optimizer": "cpu" if offload else "none"}
    if offload:
        cfg["offload"] = {"pipeline": "staged", "delayed_update": delayed, "threads": THREADS}
    return cfg


def run(cfg, a, dev, offload: bool, delayed: bool = False, gas: int = 1) -> dict:
    t0 = time.perf_counter()
    engine = zerompi.initialize(new_model(cfg, dev), config(offload, delayed, gas))
    rec = {"gas": gas, "tokens_per_step": a.micro * a.seq * gas, "build_s": time.perf_counter() - t0}
    data = list(batches(cfg, a.micro, a.seq, dev, gas))

    def step():
        for x, y in data:
            _, loss = engine(x, y)
            engine.backward(loss)
            engine.step()
        return loss
    for _ in range(a.warmup):
        step()
    sync(dev)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    t0 = time.perf_counter()
    for _ in range(a.steps):
        loss = step()
    sync(dev)
    rec["step_s"] = (time.perf_counter() - t0) / a.steps
    rec["loss"] = float(loss)
    if dev.type == "cuda":
        rec["peak_memory_bytes"] = torch.cuda.max_memory_allocated(dev)
    # one instrumented step: forward+backward of its micro-batches, then the update
    t0 = time.perf_counter()
    for i, (x, y) in enumerate(data):
        _, loss = engine(x, y)
        engine.backward(loss)
        if i == gas - 1:
            torch.cuda.current_stream(dev).synchronize() if dev.type == "cuda" else None
            rec["fwd_bwd_s"] = time.perf_counter() - t0
            t1 = time.perf_counter()
        engine.step()
    sync(dev)
    rec["update_s"] = time.perf_counter() - t1
    rec["phases"] = engine.offload_phases
    rec["optimizer"] = type(engine.optimizer).__name__
    del engine
    return rec


def rates(rec: dict, mach: dict) -> dict:
    """Each phase's bytes/s beside what the machine offers."""
    ph = rec.get("phases") or {}
    out = {}
    for phase, nbytes, ref in (("d2h_busy", "grad_bytes", "d2h_GBps"), ("upload_busy", "param_bytes", "h2d_GBps"),
                               ("host_pass", "host_bytes", "host_copy_GBps")):
        if ph.get(phase) and ph.get(nbytes):
            out[phase] = {"GBps": ph[nbytes] / ph[phase] / GB, "machine_GBps": mach.get(ref)}
    return out


def capacity(dev, budget: float, known: dict) -> dict:
    """The largest LADDER model that builds and steps, without and with offload: starting
    from the largest one the memory model predicts to fit, up while it fits, down while
    it does not (a few probes: each costs seconds). `known`: {mode: fits} for the preset
    already run."""
    t_end = time.perf_counter() + budget
    if dev.type != "cuda":
        return {"skipped": "the capacity probe needs a GPU"}
    avail = mem_info().get("MemAvailable") or 0
    gpu = torch.cuda.get_device_properties(dev).total_memory
    out = {"gpu_bytes": gpu, "host_available_bytes": avail, "micro": 1, "seq": 512, "modes": {}}
    names = sorted(LADDER, key=lambda k: count_params(LADDER[k]))
    small = argparse.Namespace(micro=1, seq=512, warmup=0, steps=1)
    for offload in (False, True):
        mode = "offload" if offload else "plain"
        rec = out["modes"][mode] = {"tried": {}, "largest": None}
        # bytes per parameter while the engine builds: on the device the fp32 model, the bf16
        # flat parameters and gradients, the fp32 scratch, and without offload the fp32
        # master and moments; on the host (offload) master, moments and the bf16 staging
        per_dev, per_host = (12, 16) if offload else (24, 0)

        def host_ok(name):
            return per_host * count_params(LADDER[name]) <= 0.85 * avail

        fits_pred = [k for k in names if per_dev * count_params(LADDER[k]) <= gpu and host_ok(k)]
        i = names.index(fits_pred[-1]) if fits_pred else 0
        seen = {}
        while 0 <= i < len(names):
            name = names[i]
            n = count_params(LADDER[name])
            if name in known.get(mode, {}):
                ok = known[mode][name]
                rec["tried"][name] = {"fits": ok, "params": n, "from": "the main run"}
            elif offload and not host_ok(name):
                rec["tried"][name] = {"fits": False, "params": n, "limit": f"host memory: needs ~{per_host * n / GB:.0f}"
                                      f" GB, {avail / GB:.0f} GB available (not tried: the machine could kill the run)"}
                ok = False
            elif time.perf_counter() > t_end:
                rec["tried"][name] = {"fits": None, "limit": "capacity budget spent (not tried)"}
                break
            else:
                t0 = time.perf_counter()
                try:
                    r = run(LADDER[name], small, dev, offload)
                    rec["tried"][name] = {"fits": True, "params": n, "seconds": time.perf_counter() - t0,
                                          "peak_memory_bytes": r.get("peak_memory_bytes"), "step_s": r["step_s"]}
                    ok = True
                except torch.cuda.OutOfMemoryError as e:
                    rec["tried"][name] = {"fits": False, "params": n, "seconds": time.perf_counter() - t0,
                                          "limit": "GPU memory: " + str(e).splitlines()[0][:160],
                                          "predicted_device_bytes": per_dev * n}
                    ok = False
                release(dev)
            seen[name] = ok
            if ok:
                rec["largest"] = name if rec["largest"] is None or count_params(LADDER[name]) > \
                    count_params(LADDER[rec["largest"]]) else rec["largest"]
            step = 1 if ok else -1
            if (names[i + step] if 0 <= i + step < len(names) else None) in seen:
                break  # the boundary between a fit and a failure is found
            i += step
        if rec["largest"] is not None:
            bigger = names[names.index(rec["largest"]) + 1:]
            rec["limit"] = rec["tried"].get(bigger[0], {}).get("limit") if bigger else "the ladder's end"
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="gpt-1b", choices=sorted(PRESETS))
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--delayed", action="store_true")
    ap.add_argument("--gas", type=int, default=0, help="accumulation for the delayed comparison (0: chosen)")
    ap.add_argument("--capacity", action="store_true")
    ap.add_argument("--capacity-budget", type=float, default=60.0)
    ap.add_argument("--threads", default="auto", help="offload.threads (auto or an integer)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    global THREADS
    THREADS = a.threads if a.threads == "auto" else int(a.threads)
    dev = torch.device(a.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("bench_offload_gpu: no CUDA device visible", file=sys.stderr)
        return 2
    zerompi.runtime.init()
    cfg = PRESETS[a.preset]
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    res = {"machine": machine_info(), "torch": torch.__version__, "preset": a.preset, "micro": a.micro,
           "offload_threads_setting": THREADS,
           "seq": a.seq, "device": str(dev), "params": count_params(cfg), "failed": []}
    if dev.type == "cuda":
        res["gpu"] = torch.cuda.get_device_name(dev)

    def part(key, fn):
        t0 = time.perf_counter()
        try:
            res[key] = fn()
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            res[key] = {"error": f"{type(e).__name__}: {e}"}
            res["failed"].append(key)
        res.setdefault("seconds", {})[key] = time.perf_counter() - t0
        out.write_text(json.dumps(res, indent=1, default=str))
        release(dev)
        print(f"bench_offload_gpu: {key} done in {res['seconds'][key]:.1f}s", flush=True)

    part("machine", lambda: machine(dev))
    part("offload", lambda: run(cfg, a, dev, True))
    part("plain", lambda: run(cfg, a, dev, False))
    mach = res.get("machine", {})
    if "phases" in res.get("offload", {}):
        res["offload"]["rates"] = rates(res["offload"], mach)
        ph = res["offload"]["phases"]
        res["offload"]["summary"] = {k: ph.get(k) for k in ("grad_stats", "d2h_wait", "host_pass", "host_update",
                                                            "after_update", "step", "threads", "kernel")}
    if a.delayed:
        gas = a.gas
        if not gas:
            host = (res.get("offload", {}).get("phases") or {}).get("host_pass") or 0.0
            fb = res.get("plain", {}).get("fwd_bwd_s") or res.get("offload", {}).get("fwd_bwd_s") or 1.0
            gas = max(1, min(16, math.ceil(1.1 * host / fb)))
        res["delayed_gas"] = gas
        part("delayed_plain", lambda: run(cfg, a, dev, False, gas=gas))
        part("delayed", lambda: run(cfg, a, dev, True, delayed=True, gas=gas))
        p, d = res.get("delayed_plain", {}), res.get("delayed", {})
        if "step_s" in p and "step_s" in d:
            res["delayed_ratio_vs_plain"] = d["step_s"] / p["step_s"]
            res["delayed_batch"] = f"micro {a.micro} x gas {gas} x seq {a.seq} = {a.micro * gas * a.seq} tokens"
    if a.capacity:
        known = {m: {a.preset: "step_s" in res.get(m, {})} for m in ("offload", "plain")
                 if a.preset in LADDER and m in res}
        part("capacity", lambda: capacity(dev, a.capacity_budget, known))
    off = res.get("offload", {})
    res["accept"] = {"offload_step_s<=0.8": off.get("step_s", 1e9) <= 0.8,
                     "peak_gpu_gb<=11.7": off.get("peak_memory_bytes", 1e18) <= 11.7e9,
                     "delayed<=1.2x_plain": res.get("delayed_ratio_vs_plain", 1e9) <= 1.2 if a.delayed else None}
    out.write_text(json.dumps(res, indent=1, default=str))
    print(json.dumps({k: res.get(k) for k in ("accept", "delayed_batch", "delayed_ratio_vs_plain")}, default=str))
    return 1 if res["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
