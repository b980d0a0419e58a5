"""The offloaded optimizer's host pass against what the host's memory offers.

    python benchmarks/bench_offload_host.py [--elements 5e7] [--threads 1,2,...] [--repeat 5]
        [--out benchmarks/results/offload_host_<machine>_<yyyymm>.json]   (+ .png)
    python benchmarks/bench_offload_host.py --replot RESULT.json

Per thread count T, on one shard of n elements (bf16 gradients in, bf16 parameters out):
  pass        the compiled host pass (cuda_src/host_adamw.cpp): unscale x clip, AdamW,
              the cast; reads 2 + 12 and writes 12 + 2 bytes per element
  copy        torch's copy of a buffer of the pass's read bytes (14 n) into another, with
              torch at T threads: the same bytes read and written, the memory's reference
              (the faster of a uint8 and a float32 copy)
  torch       what torch offers for the same update: the gradient to fp32 (a copy and a
              multiply), torch._fused_adamw_, and the cast into the output
Bytes/s = 28 n / seconds for all three; the best of --repeat rounds after a warm-up, the
three taking turns within a round (a shared machine's busy moments hit all alike). The
pass's acceptance: >= 70% of copy's bytes/s, and faster than torch, at the
thread count the engine uses (offload.threads auto: the cores).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from harness import machine_info, machine_name, result_path, write_json  # first: puts this checkout's zerompi on sys.path

import torch  # noqa: E402

from zerompi.kernels import adamw_table as kt  # noqa: E402
from zerompi.kernels.adamw import adamw_scalars  # noqa: E402
from zerompi.optim import host_kernel  # noqa: E402
from zerompi.optim.adamw import Segment  # noqa: E402
from zerompi.optim.host_pass import build_units  # noqa: E402

HP = dict(lr=3e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
BYTES_PER_ELEMENT = 28


def best(fns: dict, repeat: int) -> dict:
    """Best seconds of each function over `repeat` rounds after a warm-up; the functions
    take turns within a round, so a busy moment of a shared machine hits all alike."""
    for fn in fns.values():
        fn()
    out = {k: float("inf") for k in fns}
    for _ in range(repeat):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            out[k] = min(out[k], time.perf_counter() - t0)
    return out


def measure(n: int, threads: list[int], repeat: int) -> list[dict]:
    g = torch.randn(n).to(torch.bfloat16)
    master, m, v = torch.randn(n), torch.randn(n) * 1e-3, torch.rand(n) * 1e-4
    out = torch.empty(n, dtype=torch.bfloat16)
    units = build_units([Segment(0, 0, n, 0, 0, 0)], n, [0, n])
    rows = kt.step_row(adamw_scalars(step=10, grad_coef=0.5, **HP))[None]
    src = torch.ones(14 * n, dtype=torch.uint8)
    dst = torch.zeros_like(src)
    src32, dst32 = src.view(torch.float32), dst.view(torch.float32)
    g32 = torch.empty(n)
    count = torch.tensor(10.0)

    def fused():
        g32.copy_(g).mul_(0.5)
        torch._fused_adamw_([master], [g32], [m], [v], [], [count], lr=HP["lr"], beta1=HP["beta1"],
                            beta2=HP["beta2"], weight_decay=HP["weight_decay"], eps=HP["eps"],
                            amsgrad=False, maximize=False)
        out.copy_(master)

    rowsout = []
    for t in threads:
        torch.set_num_threads(t)
        fns = {"copy8": lambda: dst.copy_(src), "copy32": lambda: dst32.copy_(src32), "torch": fused}
        if host_kernel.library() is not None:
            fns["pass"] = lambda: host_kernel.launch(master, m, v, g, out, units, rows, 1, t).join()
        got = best(fns, repeat)
        rec = {"threads": t, "copy_s": min(got.pop("copy8"), got.pop("copy32"))}
        rec.update({f"{k}_s": v for k, v in got.items()})
        for k in ("copy", "torch", "pass"):
            if f"{k}_s" in rec:
                rec[f"{k}_GBps"] = BYTES_PER_ELEMENT * n / rec[f"{k}_s"] / 1e9
        if "pass_s" in rec:
            rec["pass_vs_copy"] = rec["copy_s"] / rec["pass_s"]
            rec["pass_vs_torch"] = rec["torch_s"] / rec["pass_s"]
        print(json.dumps(rec), flush=True)
        rowsout.append(rec)
    return rowsout


def plot(result: dict, png: Path) -> None:
    from harness import pyplot, save_figure

    plt = pyplot()
    rows = result["rows"]
    t = [r["threads"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, label in (("copy_GBps", "torch copy of the same bytes"), ("pass_GBps", "fused host pass (compiled)"),
                       ("torch_GBps", "torch: to fp32, _fused_adamw_, cast")):
        if all(key in r for r in rows):
            ax.plot(t, [r[key] for r in rows], "o-", label=label)
    ax.set_xlabel("threads")
    ax.set_ylabel(f"GB/s ({BYTES_PER_ELEMENT} bytes per element)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(fig, png, f"offload host pass, {result['elements']:.3g} elements, {result['machine_name']}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--elements", type=float, default=5e7)
    ap.add_argument("--threads", default=None, help="comma-separated; default 1..cores")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", default=None)
    ap.add_argument("--replot", default=None, metavar="JSON")
    a = ap.parse_args(argv)
    if a.replot:
        plot(json.loads(Path(a.replot).read_text()), Path(a.replot).with_suffix(".png"))
        return 0
    info = machine_info()
    out = Path(a.out) if a.out else result_path("offload_host")
    name = machine_name()
    cores = len(os.sched_getaffinity(0))
    threads = [int(x) for x in a.threads.split(",")] if a.threads else list(range(1, cores + 1))
    lib = host_kernel.library()
    result = {"machine": info, "machine_name": name, "torch": torch.__version__, "elements": int(a.elements),
              "bytes_per_element": BYTES_PER_ELEMENT, "compiled": lib is not None, "why_not": host_kernel.reason(),
              "date": time.strftime("%Y-%m-%d"), "load_average_before": os.getloadavg()}
    result["rows"] = measure(int(a.elements), threads, a.repeat)
    at = result["rows"][-1]
    result["at_all_cores"] = at
    result["accept"] = {"pass_vs_copy>=0.7": at.get("pass_vs_copy", 0) >= 0.7,
                        "pass_faster_than_torch": at.get("pass_vs_torch", 0) > 1}
    write_json(out, result)
    plot(result, out.with_suffix(".png"))
    print(f"wrote {out} (+ .png); accept: {result['accept']}")
    return 0 if all(result["accept"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
