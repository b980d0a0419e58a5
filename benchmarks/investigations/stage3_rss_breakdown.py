#!/usr/bin/env python
"""Where stage 3's peak RSS per rank goes, with the gather pool and without it.

    python benchmarks/investigations/stage3_rss_breakdown.py \
        --out benchmarks/investigations/results/stage3_rss_breakdown.json

Runs an N-rank job (launch.py) of this file's per-rank worker once per side: "pool" (this checkout),
"no_pool" (the same code with zero/gather_pool.available() forced False, so every
gather allocates its unit and every release frees it, as before the pool) and "no_trim"
(the same code with runtime.malloc.HeapTrimmer disabled: backward's freed heap memory stays
resident until reused). Step wall times are recorded too (rank 0, per step). Same model,
data and glibc defaults on both sides: no ZEROMPI_MALLOC, GLIBC_TUNABLES or MALLOC_*
variables reach the ranks (they are removed from the environment).

Per rank and step it records the kernel's peak RSS (VmHWM, reset through
/proc/self/clear_refs before the first step) and samples glibc's mallinfo2() and the
current RSS at every block's forward entry/exit, every parameter's gradient and the phase
ends. The steps' peak RSS is then split as
    live malloc bytes at their peak (heap in use + mmapped blocks: model states, buffers,
      pool, activations, gradients, Python and torch objects)
  + what was resident outside malloc at start-up (code, Python's own arenas, MPI)
  + the rest: resident memory malloc holds but has not handed out (heap holes, freed
    blocks kept), plus growth outside malloc (MPI shared memory, thread stacks).
Also (pool side, where gathers do not touch the heap): the heap bytes each block's
forward keeps for backward (its activations).

Rank 0 also checks the idea of giving gathered parameters a .grad before backward
(autograd would accumulate into it): torch's profiler shows whether the backward still
allocates a gradient of the weight's size.
"""
from __future__ import annotations

import argparse
import ctypes
import datetime as _dt
import json
import os
import resource
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # benchmarks/: this study sits one folder down
from bench_env import machine_info, software_info  # noqa: E402
from launch import launch  # noqa: E402

MiB = 1 << 20
MACHINE = "vm, 2-core AMD EPYC, 24 GiB, torch 2.13.0+cpu, pip MPICH"
SHAPE = dict(vocab_size=256, block_size=1024, n_layer=19, n_head=12, n_embd=768)  # "gpt-135m"
# launch.py drops glibc's allocator variables; zerompi's own switch goes too
ALLOC_VARS = ("ZEROMPI_MALLOC", "GLIBC_TUNABLES", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_",
              "MALLOC_ARENA_MAX", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")


class _MI2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                               "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def _probe():
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MI2
    page = os.sysconf("SC_PAGE_SIZE")

    def sample(tag: str) -> dict:
        m = libc.mallinfo2()
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * page
        return {"tag": tag, "rss": rss, "heap": m.arena, "heap_used": m.uordblks,
                "heap_free": m.fordblks, "mmapped": m.hblkhd}
    return sample


def _vm_hwm() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _grad_preset_check() -> dict:
    """Linear(768, 3072) backward with and without a .grad set beforehand."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    lin, x = torch.nn.Linear(768, 3072), torch.randn(256, 768, requires_grad=True)
    size = lin.weight.numel() * 4
    out = {"weight_bytes": size}
    for preset in (False, True):
        lin.weight.grad = torch.zeros_like(lin.weight) if preset else None
        ptr = lin.weight.grad.data_ptr() if preset else None
        y = lin(x).sum()
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            y.backward()
        allocs = sorted({(e.name, e.cpu_memory_usage) for e in prof.events()
                         if e.name.startswith("aten::") and e.cpu_memory_usage >= size})
        out["grad_preset" if preset else "no_grad"] = {
            "aten_allocations_of_weight_size": allocs,
            "grad_kept_its_storage": (lin.weight.grad.data_ptr() == ptr) if preset else None}
    return out


def worker(args) -> None:
    import torch
    from mpi4py import MPI

    import zerompi
    from zerompi.models.gpt import GPT, GPTConfig
    from zerompi.zero import gather_pool

    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    sample = _probe()
    if args.side == "no_pool":
        gather_pool.available = lambda: False
    from zerompi import runtime
    trim_s = [0.0]  # time inside malloc_trim (the trimming's own cost; its page faults: minflt)
    if args.side == "no_trim":
        from zerompi.runtime.malloc import HeapTrimmer
        HeapTrimmer.released = lambda self, nbytes: None
    else:
        if os.environ.get("TRIM_EVERY_MIB"):  # experiment: trim less often
            from zerompi.runtime.malloc import HeapTrimmer
            HeapTrimmer.EVERY = int(os.environ["TRIM_EVERY_MIB"]) << 20

        def timed(f=runtime.malloc.release_free_memory):
            t = time.perf_counter()
            f()
            trim_s[0] += time.perf_counter() - t
        runtime.malloc.release_free_memory = timed
    cfg = {"stage": 3, "precision": "fp32",
           "optimizer": {"lr": 1e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}}
    if args.activation_checkpointing:  # ZeRO-R: block checkpoints in the contiguous arena
        cfg["activation_checkpointing"] = {"enabled": True, "contiguous": True}
    marks = {"start": sample("start")}
    with zerompi.Init(cfg, seed=0):  # as benchmarks/dp_systems.py builds zerompi-3
        model = GPT(GPTConfig(**SHAPE))
    marks["model"] = sample("model")
    eng = zerompi.initialize(model, cfg)
    marks["engine"] = sample("engine")
    trace: list[dict] = []
    for i, blk in enumerate(model.h):
        blk.register_forward_pre_hook(lambda m, a, i=i: trace.append(sample(f"fwd h.{i} <")))
        blk.register_forward_hook(lambda m, a, o, i=i: trace.append(sample(f"fwd h.{i} >")))
    for n, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, n=n: trace.append(sample(f"grad {n}")))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := current RSS: the steps' peak excludes set-up
    steps = []
    for s in range(args.steps):
        g = torch.Generator().manual_seed(rank * 10_007 + s)
        t = torch.randint(0, SHAPE["vocab_size"], (args.micro_batch, args.seq_len + 1), generator=g)
        x, y = t[:, :-1].contiguous(), t[:, 1:].contiguous()
        trace.clear()
        trim_s[0], flt0 = 0.0, resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        trace.append(sample("step start"))
        _, loss = eng(x, y)
        trace.append(sample("forward done"))
        eng.backward(loss)
        trace.append(sample("backward done"))
        eng.step()
        trace.append(sample("step done"))
        peak = max(trace, key=lambda d: d["rss"])
        live = max(trace, key=lambda d: d["heap_used"] + d["mmapped"])
        acts = [b["heap_used"] - a["heap_used"] for a, b in zip(trace, trace[1:])
                if a["tag"].endswith("<") and b["tag"] == a["tag"][:-1] + ">"]
        steps.append({"step": s, "wall_s": time.perf_counter() - t0, "trim_s": trim_s[0],
                      "minor_faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - flt0, "loss": float(loss.detach()), "vm_hwm": _vm_hwm(),
                      "sampled_peak": peak, "live_peak": {**live, "bytes": live["heap_used"] + live["mmapped"]},
                      "activation_bytes_per_block_median": sorted(acts)[len(acts) // 2] if acts else None,
                      "at_step_start": trace[0], "at_forward_done": next(d for d in trace if d["tag"] == "forward done")})
    rep = eng.memory_report()
    res = {"rank": rank, "marks": marks, "steps": steps, "memory_report": rep, "peak_rss_steps": _vm_hwm()}
    gathered = comm.gather(res, root=0)
    if rank == 0:
        doc = {"side": args.side, "ranks": gathered}
        if args.side == "pool":  # a property of torch, not of the side
            doc["grad_preset_check"] = _grad_preset_check()
        Path(args.out).write_text(json.dumps(doc))


def _split(r: dict) -> dict:
    """One rank's steps peak RSS as live malloc bytes + start-up non-malloc + the rest (MiB)."""
    st = r["marks"]["start"]
    outside = st["rss"] - st["heap_used"] - st["mmapped"]  # the heap is compact at start-up
    live = max((s["live_peak"] for s in r["steps"]), key=lambda d: d["bytes"])
    out = {"peak_rss_steps": r["peak_rss_steps"], "live_malloc_peak": live["bytes"],
           "of_which_mmapped": live["mmapped"], "of_which_heap_in_use": live["heap_used"],
           "outside_malloc_at_start": outside,
           "allocator_kept_and_other_growth": r["peak_rss_steps"] - live["bytes"] - outside}
    return {**{k: round(v / MiB, 1) for k, v in out.items()}, "live_peak_at": live["tag"]}


def summarize(side: dict) -> dict:
    ranks = side["ranks"]
    worst = max(ranks, key=lambda r: r["peak_rss_steps"])
    acts = ranks[0]["steps"][-1]["activation_bytes_per_block_median"]
    return {"peak_rss_steps_per_rank_MiB": [round(r["peak_rss_steps"] / MiB, 1) for r in ranks],
            "peak_rss_steps_max_rank_GiB": round(worst["peak_rss_steps"] / (1 << 30), 3),
            "split_of_the_highest_rank_MiB": _split(worst),
            "allocator_kept_and_other_growth_per_rank_MiB": [
                _split(r)["allocator_kept_and_other_growth"] for r in ranks],
            "activation_MiB_per_block": round(acts / MiB, 2) if side["side"] != "no_pool" else None,
            "memory_report_MiB": {k: round(v / MiB, 1) for k, v in ranks[0]["memory_report"].items()
                                  if k not in ("numel", "padded_numel", "gather_fallbacks")},
            "gather_fallbacks": ranks[0]["memory_report"].get("gather_fallbacks"),
            "losses_rank0": [s["loss"] for s in ranks[0]["steps"]],
            "step_wall_s_rank0": [round(s["wall_s"], 2) for s in ranks[0]["steps"]],
            "trim_s_per_step_max_rank": [round(max(r["steps"][i]["trim_s"] for r in ranks), 4)
                                         for i in range(len(ranks[0]["steps"]))],
            "minor_faults_per_step_rank0": [s["minor_faults"] for s in ranks[0]["steps"]]}


def driver(args) -> None:
    doc = {"benchmark": "stage3_rss_breakdown: peak RSS per rank of the 135M GPT, stage 3, fp32, "
                        "glibc defaults, sides: this checkout (pool), without the gather pool (no_pool), without heap trimming (no_trim)",
           "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
           "machine_label": MACHINE, "machine": machine_info(), "software": software_info(),
           "command": " ".join([sys.executable] + sys.argv),
           "parameters": {"model": "gpt-135m", "shape": SHAPE, "n": args.nranks, "stage": 3,
                          "precision": "fp32", "micro_batch": args.micro_batch, "seq_len": args.seq_len,
                          "steps": args.steps, "repeats": args.repeats, "threads_per_rank": 1,
                          "allocator_env_removed": list(ALLOC_VARS),
                          "activation_checkpointing": args.activation_checkpointing},
           "loadavg_at_start": list(os.getloadavg()), "runs": {}}
    for rep in range(args.repeats):
        sides = args.sides.split(",")
        for side in (sides if rep % 2 == 0 else sides[::-1]):
            tmp = Path(args.out).with_suffix(f".{side}.{rep}.tmp.json")
            argv = [Path(__file__).resolve(), "--worker", "--side", side, "--out", tmp,
                    "--steps", args.steps, "--micro-batch", args.micro_batch, "--seq-len", args.seq_len]
            argv += ["--activation-checkpointing"] if args.activation_checkpointing else []
            job = launch(args.nranks, argv, timeout=args.timeout, env={"ZEROMPI_MALLOC": None})
            if not job.ok:
                sys.exit(f"{side}: exit {job.status}\n{job.tail(6000)}")
            run = json.loads(tmp.read_text())
            tmp.unlink()
            doc["runs"].setdefault(side, []).append({"summary": summarize(run), "raw": run})
            print(f"[rss] {side} repeat {rep}: peak RSS per rank (steps) "
                  f"{doc['runs'][side][-1]['summary']['peak_rss_steps_per_rank_MiB']} MiB", flush=True)
    first = doc["runs"][args.sides.split(",")[0]][0]["raw"]
    doc["grad_preset_check"] = first.pop("grad_preset_check", None)
    doc["loadavg_at_end"] = list(os.getloadavg())
    Path(args.out).write_text(json.dumps(doc, indent=1))
    print(f"[rss] wrote {args.out}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(HERE / "results" / "stage3_rss_breakdown.json"))
    ap.add_argument("--nranks", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--sides", default="pool,no_pool", help="comma-separated: pool, no_pool, no_trim")
    ap.add_argument("--activation-checkpointing", action="store_true",
                    help="zero.activation_checkpointing enabled + contiguous (ZeRO-R's arena)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--side", default="pool", choices=["pool", "no_pool", "no_trim"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
    else:
        driver(args)


if __name__ == "__main__":
    main()
