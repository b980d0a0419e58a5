"""Seconds to get pinned host memory, per way of getting it, on this machine's GPU.

    python benchmarks/bench_pinned_alloc.py --out pinned.json [--gib 0.25,1,4] [--budget 45]

Why: optimizer offload keeps master weights, moments and gradients in pinned host
memory (several GB per rank for a 1B model), and on the first H100 run (a Firecracker
VM) the 1B offload case spent its whole 120 s step allocating them. Three ways:
  caching   torch.empty(pin_memory=True): torch's caching host allocator (cudaHostAlloc;
            it rounds each request up to a power of two)
  register  an ordinary host tensor, touched, then cudaHostRegister over its pages
  caching+register-threads  the caching allocator with
            PYTORCH_CUDA_ALLOC_CONF=pinned_use_cuda_host_register:True,pinned_num_register_threads:8
            (a subprocess: the setting is read once)
Each is timed to a zeroed tensor (what Placement.zeros returns), then freed. Results are
written after every measurement, so a run cut off keeps what it has; sizes run
smallest first and stop when the budget is spent.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

GIB = 1 << 30


def caching(nbytes: int) -> float:
    t0 = time.perf_counter()
    t = torch.empty(nbytes // 4, dtype=torch.float32, pin_memory=True).zero_()
    dt = time.perf_counter() - t0
    del t
    return dt


def register(nbytes: int) -> float:
    rt = torch.cuda.cudart()
    t0 = time.perf_counter()
    t = torch.empty(nbytes // 4, dtype=torch.float32).zero_()
    err = rt.cudaHostRegister(t.data_ptr(), nbytes, 0)
    dt = time.perf_counter() - t0
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister: error {err}")
    rt.cudaHostUnregister(t.data_ptr())
    return dt


def in_subprocess(nbytes: int, timeout: float) -> float:
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="pinned_use_cuda_host_register:True,"
               "pinned_num_register_threads:8")
    code = (f"import torch, time, sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); "
            f"import bench_pinned_alloc as b; torch.cuda.init(); print(b.caching({nbytes}))")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=timeout, check=True)
    return float(r.stdout.split()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--gib", default="0.25,1,4")
    ap.add_argument("--budget", type=float, default=45.0)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_pinned_alloc: no CUDA device visible", file=sys.stderr)
        return 2
    torch.cuda.init()
    res = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "seconds": {}}
    t_start = time.perf_counter()
    for g in map(float, a.gib.split(",")):
        nbytes = int(g * GIB)
        row = res["seconds"].setdefault(f"{g:g} GiB", {})
        for name, fn in [("caching", caching), ("register", register),
                         ("caching+register-threads",
                          lambda n: in_subprocess(n, max(1.0, a.budget - (time.perf_counter() - t_start))))]:
            if time.perf_counter() - t_start > a.budget:
                row[name] = "budget spent"
                continue
            try:
                row[name] = round(fn(nbytes), 4)
            except Exception as e:  # one way failing must not cost the others
                row[name] = f"error: {type(e).__name__}: {e}"[:300]
            print(f"{g:g} GiB {name}: {row[name]}", flush=True)
            with open(a.out, "w") as f:
                json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
