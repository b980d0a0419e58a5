"""GPU kernel bandwidth: the table-driven fused AdamW, the overflow + norm
kernel and the fp32 -> bf16 cast, against the same GPU's device-to-device copy
bandwidth measured in the same run, and the fused AdamW's time against
torch.optim.AdamW(fused=True) doing the same update on the same number of elements.

    python benchmarks/bench_kernels_gpu.py --sizes 1e7,1e8,1e9 \
        --out benchmarks/results/kernels_gpu.json

Bytes per element, counted as the kernels move them: AdamW reads master, exp_avg,
exp_avg_sq (fp32) and the gradient (2 or 4 bytes) and writes the three fp32 buffers and
the bf16 parameter (2): 26 bytes with bf16 gradients, 28 with fp32. The copy moves 8
bytes per fp32 element (read + write). Timing: CUDA events around `--repeats` launches
after `--warmup` ones; the median is reported. NOT YET RUN ON A GPU: written while no GPU
was lent (see the issue notes); expect to fix small things on the first run.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

from harness import machine_info  # first: puts this checkout's zerompi on sys.path
from zerompi.kernels import adamw_table as kt  # noqa: E402
from zerompi.kernels import cast as kcast  # noqa: E402
from zerompi.kernels.adamw import adamw_scalars  # noqa: E402
from zerompi.kernels.streams import cupy_stream  # noqa: E402

SEGMENT = 1 << 22  # a shard is many parameter pieces: 4M-element segments, as a GPT's


def timed(fn, warmup: int, repeats: int) -> float:
    """Median seconds of fn() on the current stream."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def copy_bandwidth(n: int, warmup: int, repeats: int) -> float:
    src = torch.empty(n, dtype=torch.float32, device="cuda").uniform_()
    dst = torch.empty_like(src)
    t = timed(lambda: dst.copy_(src), warmup, repeats)
    return 8 * n / t


def as_cupy(t: torch.Tensor):
    import cupy

    return cupy.from_dlpack(t.view(torch.int16) if t.dtype == torch.bfloat16 else t)


def bench_size(n: int, grad_dtype: torch.dtype, warmup: int, repeats: int) -> dict:
    import cupy

    dev = torch.device("cuda")
    master = torch.randn(n, device=dev)
    m, v = torch.zeros(n, device=dev), torch.zeros(n, device=dev)
    grad = torch.randn(n, device=dev).to(grad_dtype)
    out = torch.empty(n, dtype=torch.bfloat16, device=dev)
    lengths = [min(SEGMENT, n - lo) for lo in range(0, n, SEGMENT)]
    offs = np.cumsum([0] + lengths[:-1]).astype(np.int64)
    table = kt.build_table(lengths, offs, offs, offs, offs)
    row = kt.step_row(adamw_scalars(lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1,
                                    step=10, grad_coef=0.5))
    rows = torch.from_numpy(np.tile(row, (table.nseg, 1))).to(dev)
    segs, tiles = cupy.asarray(table.segs), cupy.asarray(table.tiles)
    c = {k: as_cupy(t) for k, t in (("master", master), ("m", m), ("v", v), ("grad", grad),
                                    ("out", out), ("rows", rows))}
    stream = torch.cuda.current_stream()
    with cupy_stream(cupy, stream, torch.cuda.current_device()):
        t_adamw = timed(lambda: kt.adamw_table_step(c["master"], c["m"], c["v"], c["grad"], c["out"],
                                                    segs, tiles, c["rows"]), warmup, repeats)
        weights = cupy.ones(table.nseg, np.float64)
        res = (cupy.empty(1, np.float64), cupy.empty(1, np.int32))
        scratch = (cupy.empty(table.ntiles, np.float64), cupy.empty(table.ntiles, np.int32))
        t_stats = timed(lambda: kt.grad_stats_table(c["grad"], segs, tiles, weights, res, scratch),
                        warmup, repeats)
        t_cast = timed(lambda: kcast.cast_into(c["master"], c["out"]), warmup, repeats)
    gbytes = grad.element_size()
    rec = {"n": n, "grad_dtype": str(grad_dtype).replace("torch.", ""),
           "adamw_s": t_adamw, "adamw_bytes_per_s": (26 - 2 + gbytes) * n / t_adamw,
           "stats_s": t_stats, "stats_bytes_per_s": gbytes * n / t_stats,
           "cast_s": t_cast, "cast_bytes_per_s": 6 * n / t_cast}
    del master, m, v, out, c
    # torch's fused AdamW on the same elements (fp32 parameter and gradient: its fused
    # path needs them in one dtype; it neither unscales/clips nor writes a bf16 copy)
    p = torch.nn.Parameter(torch.randn(n, device=dev))
    p.grad = grad.float()
    del grad
    opt = torch.optim.AdamW([p], lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    rec["torch_fused_adamw_s"] = timed(opt.step, warmup, repeats)
    rec["speedup_vs_torch_fused"] = rec["torch_fused_adamw_s"] / t_adamw
    del p, opt
    torch.cuda.empty_cache()
    return rec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1e7,1e8,1e9")
    ap.add_argument("--grads", default="bf16,fp32")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default="benchmarks/results/kernels_gpu.json")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_kernels_gpu: no CUDA device visible", file=sys.stderr)
        return 2
    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32}
    copy_bw = copy_bandwidth(1 << 28, a.warmup, a.repeats)  # 1 GiB each way
    runs = []
    for n in (int(float(s)) for s in a.sizes.split(",")):
        for g in a.grads.split(","):
            rec = bench_size(n, dtypes[g], a.warmup, a.repeats)
            for k in ("adamw", "stats", "cast"):
                rec[f"{k}_of_copy"] = rec[f"{k}_bytes_per_s"] / copy_bw
            runs.append(rec)
            print(f"n={n:.0e} grad={g}: adamw {rec['adamw_of_copy']:.1%} of copy, "
                  f"{rec['speedup_vs_torch_fused']:.2f}x torch fused; stats {rec['stats_of_copy']:.1%}; "
                  f"cast {rec['cast_of_copy']:.1%}", flush=True)
    props = torch.cuda.get_device_properties(0)
    result = {"gpu": props.name, "gpu_memory_bytes": props.total_memory, "machine": machine_info(),
              "torch": torch.__version__, "copy_bytes_per_s": copy_bw, "runs": runs}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
