#!/usr/bin/env python
"""Data-parallel CPU benchmark: zerompi stages 0-3 vs torch DDP, ZeroRedundancyOptimizer,
FSDP2 and DeepSpeed ZeRO.

Worker mode (one MPI job = one system x model x N, so peak RSS belongs to that system):

    mpiexec -n 2 python -m mpi4py benchmarks/bench_dp.py --system zerompi-3 --model gpt-20m --out r.json

Driver mode (loops systems x models x N x malloc settings, one mpiexec each, merges the
per-run JSON into one file and draws the PNG with benchmarks/plot_dp.py):

    python benchmarks/bench_dp.py --driver --out benchmarks/results/dp_cpu.json \
        --png benchmarks/results/dp_cpu.png

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
import datetime as _dt
import json
import os
import platform
import resource
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

GiB = 1 << 30
SYSTEMS = ("zerompi-0", "zerompi-1", "zerompi-2", "zerompi-3", "ddp", "torch-zero", "fsdp2",
           "deepspeed-3")
OPTIONAL_SYSTEMS = ("deepspeed-1", "deepspeed-2", "zerompi-0-bf16", "zerompi-1-bf16",
                    "zerompi-2-bf16", "zerompi-3-bf16")
# Per-rank micro-batch (sequences) and sequence length per model; identical for all systems.
DEFAULT_SHAPES = {"tiny": (2, 64), "small": (2, 128), "gpt-20m": (4, 256), "gpt-200m": (1, 256)}
MALLOC_ENVS = {
    "default": {},
    # glibc keeps freed large blocks in the heap once its dynamic mmap threshold has
    # grown; a fixed 128 KiB threshold returns them to the OS, so RSS follows frees.
    "mmap128k": {"MALLOC_MMAP_THRESHOLD_": "131072"},
}
# Environment for every rank: loopback only, one compute thread per rank.
RANK_ENV = {
    "GLOO_SOCKET_IFNAME": "lo", "UCX_NET_DEVICES": "lo",
    "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
}


# ---------------------------------------------------------------------------- helpers
def parse_system(name: str) -> tuple[str, int | None, str]:
    """'zerompi-2-bf16' -> ('zerompi', 2, 'bf16'); 'ddp' -> ('ddp', None, 'fp32');
    'fsdp2' -> ('fsdp2', 3, 'fp32'); 'deepspeed-3' -> ('deepspeed', 3, 'fp32')."""
    if name in ("ddp", "torch-zero"):
        return name, None, "fp32"
    if name == "fsdp2":  # fully sharded: the stage-3 equivalent
        return name, 3, "fp32"
    parts = name.split("-")
    if parts[0] == "deepspeed" and len(parts) == 2 and parts[1] in ("1", "2", "3"):
        return "deepspeed", int(parts[1]), "fp32"
    if parts[0] != "zerompi" or len(parts) not in (2, 3) or parts[1] not in ("0", "1", "2", "3") \
            or (len(parts) == 3 and parts[2] not in ("fp32", "bf16")):
        raise ValueError(f"--system {name!r}: one of {SYSTEMS + OPTIONAL_SYSTEMS}")
    return "zerompi", int(parts[1]), parts[2] if len(parts) == 3 else "fp32"


def expected_model_state_bytes(system: str, psi: int, n: int) -> int:
    """ZeRO paper formulas (bytes per rank for Psi parameters, N ranks, Adam).

    fp32: 4 params + 4 grads + 8 moments; bf16: 2 params + 2 grads + 12 (fp32 master + moments)."""
    kind, stage, prec = parse_system(system)
    if kind == "ddp":
        return 16 * psi
    if kind == "torch-zero":  # optimizer-state sharding only, like stage 1
        return 8 * psi + 8 * psi // n
    if prec == "fp32":  # zerompi, fsdp2 (stage 3), deepspeed
        return {0: 16 * psi, 1: 8 * psi + 8 * psi // n, 2: 4 * psi + 12 * psi // n,
                3: 16 * psi // n}[stage]
    return {0: 16 * psi, 1: 4 * psi + 12 * psi // n, 2: 2 * psi + 14 * psi // n,
            3: 16 * psi // n}[stage]


def current_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_process() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def vm_hwm() -> int | None:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return None


def reset_hwm() -> bool:
    """Reset the kernel's peak-RSS mark to the current RSS (Linux >= 4.0), so the
    training-steps peak excludes set-up transients such as the model's initial copy."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def mem_info() -> dict:
    out = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                k, v = line.split(":", 1)
                if k in ("MemTotal", "MemAvailable"):
                    out[k] = int(v.split()[0]) * 1024
    except OSError:
        pass
    return out


def machine_info() -> dict:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mi = mem_info()
    return {"node": platform.node(), "processor": platform.processor(), "cpu_model": cpu,
            "cores": os.cpu_count(), "ram_bytes": mi.get("MemTotal"),
            "platform": platform.platform(), "python": platform.python_version()}


def software_info() -> dict:
    import mpi4py
    import torch
    from mpi4py import MPI

    info = {"torch": torch.__version__, "mpi4py": mpi4py.__version__,
            "mpi_library": MPI.Get_library_version().strip().splitlines()[0],
            "mpi_library_full": MPI.Get_library_version().strip()}
    try:
        import zerompi
        info["zerompi"] = zerompi.__version__
    except Exception as e:  # the torch systems must still run if zerompi is broken
        info["zerompi"] = f"import failed: {e}"
    from importlib import metadata

    try:  # metadata only: importing deepspeed would start its accelerator probing
        info["deepspeed"] = metadata.version("deepspeed")
    except metadata.PackageNotFoundError:
        info["deepspeed"] = None
    try:  # read-only git plumbing: which code was measured
        info["git_commit"] = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"],
                                            capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "diff-index", "--quiet", "HEAD", "--"])
        info["git_dirty"] = dirty.returncode != 0
    except OSError:
        pass
    return info


def quiet_barrier(comm) -> None:
    """Barrier that sleeps while waiting: MPI_Barrier spins, and with more ranks than
    cores a spinning early rank would steal the core of a rank still computing."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(5e-5)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------- worker
def _torch_dist_env(comm) -> None:
    """torch.distributed (and DeepSpeed) get rank/world from MPI; rank 0 picks the port."""
    port = comm.bcast(free_port() if comm.Get_rank() == 0 else None, root=0)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      RANK=str(comm.Get_rank()), WORLD_SIZE=str(comm.Get_size()),
                      LOCAL_RANK=str(comm.Get_rank()), LOCAL_WORLD_SIZE=str(comm.Get_size()))


def _nbytes(t) -> int:
    return t.numel() * t.element_size() if t is not None else 0


def build_system(args, gcfg, comm, marks: dict):
    """Builds the model (seeded; partitioned at construction for zerompi-3 / deepspeed-3)
    and wraps it. Returns (forward, backward, step, info-callable, cleanup). Stores the
    RSS right after model construction in marks["rss_after_model"]."""
    import torch

    from zerompi.models.gpt import GPT

    kind, stage, prec = parse_system(args.system)
    opt_kw = dict(lr=args.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=args.weight_decay)
    if kind == "zerompi":
        import zerompi

        cfg = {"stage": stage, "precision": prec,
               "optimizer": {**opt_kw, "betas": list(opt_kw["betas"])}}
        if args.bucket_size:
            cfg["bucket_size"] = args.bucket_size
        if stage == 3:
            # Init seeds with its own `seed` argument: pass ours so the weights equal
            # the other systems' (Init builds bitwise the same model as plain GPT()).
            with zerompi.Init(cfg, seed=args.seed):
                model = GPT(gcfg)
        else:
            torch.manual_seed(args.seed)
            model = GPT(gcfg)
        marks["rss_after_model"] = current_rss()
        engine = zerompi.initialize(model, cfg, comm=None)

        def step():
            engine.step()

        def info():
            rep = engine.memory_report()
            return {"memory_report": rep, "model_states_bytes": rep["model_states"],
                    "comm_stats": _jsonable(engine.comm_stats()),
                    "bucket_size": engine.config.bucket_size}

        return engine, engine.backward, step, info, lambda: None

    if kind == "deepspeed":
        return _build_deepspeed(args, gcfg, comm, marks, stage, opt_kw)

    import torch.distributed as dist

    _torch_dist_env(comm)
    dist.init_process_group("gloo", init_method="env://", rank=comm.Get_rank(),
                            world_size=comm.Get_size(), timeout=_dt.timedelta(minutes=30))
    # Every rank builds the full model from the same seed (FSDP2 too: it shards the
    # existing parameters; its whole-process peak therefore includes one full copy).
    torch.manual_seed(args.seed)
    model = GPT(gcfg)
    marks["rss_after_model"] = current_rss()
    adamw_kw = {"foreach": False} if args.torch_adamw == "for-loop" else \
        {"fused": True} if args.torch_adamw == "fused" else {}

    if kind == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (comm.Get_size(),))
        # one FSDP unit per transformer block, the root takes the rest (embeddings,
        # tied head, final norm); defaults: reshard after forward, fp32 throughout
        for blk in model.h:
            fully_shard(blk, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), **opt_kw, **adamw_kw)

        def step():
            opt.step()
            opt.zero_grad()

        def info():
            locs = [p.to_local() for p in model.parameters()]
            pbytes = sum(_nbytes(t) for t in locs)
            obytes = sum(_nbytes(t.to_local() if hasattr(t, "to_local") else t)
                         for st in opt.state.values() for t in st.values() if torch.is_tensor(t))
            return {"memory_report": {"params": pbytes, "optimizer": obytes,
                                      "note": "sharded params + optimizer state; sharded grads "
                                              "(4*Psi/N) are freed by zero_grad and added here"},
                    "model_states_bytes": 2 * pbytes + obytes}

        return model, lambda loss: loss.backward(), step, info, dist.destroy_process_group

    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(model, bucket_cap_mb=args.ddp_bucket_mb,
              gradient_as_bucket_view=bool(args.ddp_grad_view))
    if kind == "ddp":
        opt = torch.optim.AdamW(ddp.parameters(), **opt_kw, **adamw_kw)
        local_opt = opt
    else:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW,
                                      **opt_kw, **adamw_kw)
        local_opt = opt.optim

    def step():
        opt.step()
        opt.zero_grad()  # set_to_none; with bucket views DDP re-points grads at its buckets

    def info():
        params = list(model.parameters())
        pbytes = sum(p.numel() * p.element_size() for p in params)
        gbytes = sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
        obytes = sum(t.numel() * t.element_size() for st in local_opt.state.values()
                     for t in st.values() if torch.is_tensor(t))
        return {"memory_report": {"params": pbytes, "grads_live": gbytes, "optimizer": obytes,
                                  "note": "grads counted at measurement time (after zero_grad: 0); "
                                          "DDP keeps its fp32 buckets (4*Psi) in any case"},
                "model_states_bytes": pbytes + 4 * sum(p.numel() for p in params) + obytes,
                "ddp_bucket_cap_mb": args.ddp_bucket_mb,
                "ddp_gradient_as_bucket_view": bool(args.ddp_grad_view)}

    return ddp, lambda loss: loss.backward(), step, info, dist.destroy_process_group


def deepspeed_config(args, stage: int, bsz: int) -> dict:
    """fp32 DeepSpeed config with the benchmark's AdamW (torch's implementation, so no
    C++ op is built) and communication buckets of zerompi's size."""
    bucket = args.bucket_size or _zerompi_default_bucket()
    zero = {"stage": stage, "reduce_bucket_size": bucket}
    if stage < 3:
        zero["allgather_bucket_size"] = bucket
    zero.update(json.loads(args.ds_zero or "{}"))  # e.g. stage3_max_reuse_distance
    return {
        "train_micro_batch_size_per_gpu": bsz, "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0, "steps_per_print": 1 << 30, "wall_clock_breakdown": False,
        "optimizer": {"type": "AdamW", "params": {
            "lr": args.lr, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": args.weight_decay,
            "torch_adam": True}},
        "zero_optimization": zero,
    }


def _zerompi_default_bucket() -> int:
    from zerompi.config import ZeroConfig

    return ZeroConfig().bucket_size


def _replay_init_partitioned(model, deepspeed) -> None:
    """GPT() runs its weight init after its submodules exist, but under deepspeed.zero.Init
    they are partitioned by then and the init writes nothing. Re-run it with each touched
    parameter gathered alone: with the random stream where GPT() left it, this draws the
    same values as a plain GPT() (checked by equal step-0 losses), and at most one full
    parameter exists at a time."""
    import torch.nn as nn

    saved = {f: getattr(nn.init, f) for f in ("normal_", "zeros_", "ones_")}

    def wrap(fn):
        def gathered(t, *a, **k):
            if not hasattr(t, "ds_id"):
                return fn(t, *a, **k)
            # every rank draws the same values; modifier_rank=0 re-partitions on exit
            with deepspeed.zero.GatheredParameters([t], modifier_rank=0):
                fn(t, *a, **k)
            return t
        return gathered

    try:
        for f, fn in saved.items():
            setattr(nn.init, f, wrap(fn))
        model._init_weights()
    finally:
        for f, fn in saved.items():
            setattr(nn.init, f, fn)


def _build_deepspeed(args, gcfg, comm, marks, stage, opt_kw):
    # before importing deepspeed: its accelerator is chosen at import; no JIT op builds
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("DS_BUILD_OPS", "0")
    import logging

    import torch
    import deepspeed
    from deepspeed.utils import logger as ds_logger

    from zerompi.models.gpt import GPT

    ds_logger.setLevel(logging.WARNING)  # one INFO line per rank per event otherwise
    # DeepSpeed calls deprecated c10d names on every collective: one warning each
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    # Its CPU comm backend JIT-compiles a shared-memory all-reduce op at start-up (~90 s,
    # needs a C++ compiler); only inference_all_reduce uses it, training collectives go
    # through torch.distributed (gloo). Skip the build.
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    _torch_dist_env(comm)
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False,
                               timeout=_dt.timedelta(minutes=30))
    bsz = marks["micro_batch"]
    cfg = deepspeed_config(args, stage, bsz)
    torch.manual_seed(args.seed)
    if stage == 3:
        # dtype comes from the config (fp32): an explicit dtype= argument is ignored on the
        # CPU accelerator (0.19.8 evaluates `dtype or fp16 if fp16_ok else bf16...` -> bf16)
        with deepspeed.zero.Init(config_dict_or_path=cfg):
            model = GPT(gcfg)
        _replay_init_partitioned(model, deepspeed)
        bad = {p.ds_tensor.dtype for p in model.parameters()} - {torch.float32}
        if bad:
            raise RuntimeError(f"deepspeed.zero.Init built {bad} parameters, expected fp32")
    else:
        model = GPT(gcfg)
    marks["rss_after_model"] = current_rss()
    engine, opt, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                             config=cfg)

    def info():
        seen, total = set(), 0
        # params (stage 3: their partitions), fp32 partition copies, gradient partitions
        # and AdamW state, each storage once (ds_tensor are views into the flat groups);
        # after the step, so stages 1-2 show no gradients (freed)
        def add(t):
            nonlocal total
            if torch.is_tensor(t) and t.numel():
                key = t.untyped_storage().data_ptr()
                if key not in seen:
                    seen.add(key)
                    total += t.untyped_storage().nbytes()
        for p in model.parameters():
            add(getattr(p, "ds_tensor", None) if stage == 3 else p.data)
        for name in ("fp16_partitioned_groups_flat", "fp32_partitioned_groups_flat",
                     "single_partition_of_fp32_groups", "averaged_gradients",
                     "grad_partitions_flat_buffer", "bit16_groups_flat"):
            v = getattr(opt, name, None)
            for t in (v.values() if isinstance(v, dict) else v if isinstance(v, (list, tuple)) else [v]):
                for u in (t if isinstance(t, (list, tuple)) else [t]):
                    add(u)
        inner = getattr(opt, "optimizer", opt)
        for st in inner.state.values():
            for t in st.values():
                add(t)
        return {"memory_report": {"counted_storages_bytes": total,
                                  "note": "unique storages of params/partitions, fp32 partition "
                                          "copies, gradient partitions and AdamW state, after "
                                          "the step (stages 1-2 have freed their gradients)"},
                "model_states_bytes": total, "deepspeed_config": cfg}

    def cleanup():
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()

    return engine, engine.backward, engine.step, info, cleanup


def _jsonable(x):
    try:
        json.dumps(x)
        return x
    except TypeError:
        if isinstance(x, dict):
            return {str(k): _jsonable(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [_jsonable(v) for v in x]
        if hasattr(x, "__dict__"):
            return _jsonable(vars(x))
        return repr(x)


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
        "finished": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(f"[bench_dp] {args.system:15s} {args.model:9s} N={world} malloc={args.malloc_label}: "
          f"median step {med:.3f}s (cpu {res['step_cpu_s_median_mean_rank']:.3f}s/rank), "
          f"{res['tokens_per_s']:.0f} tok/s, "
          f"peak RSS/rank {res['peak_rss_process_bytes_max_rank'] / GiB:.2f} GiB "
          f"(steps {((res['peak_rss_steps_bytes_max_rank'] or 0) / GiB):.2f} GiB)", flush=True)


# ---------------------------------------------------------------------------- driver
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
                       "zerompi_bucket_size": args.bucket_size or _zerompi_default_bucket(),
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
    script = Path(__file__).resolve()
    from zerompi.models.gpt import count_params

    # DeepSpeed is optional: without it its runs are recorded as skipped, with the reason
    ds_missing = None
    if any(parse_system(s)[0] == "deepspeed" for s in systems):
        import importlib.util

        if importlib.util.find_spec("deepspeed") is None:
            ds_missing = ("deepspeed is not installed (pip install einops hjson msgpack ninja "
                          "psutil && pip install --no-deps deepspeed==0.19.8; see benchmarks/README.md)")
    default_bucket = _zerompi_default_bucket()
    plan = [(m, n, s, mal) for m in models for n in nranks for mal in mallocs for s in systems]
    t_all = time.monotonic()
    for i, (m, n, s, mal) in enumerate(plan):
        bsz, seq = shape_of(args, m)
        tag = f"{s}__{m}__n{n}__{mal}"
        psi = count_params(PRESETS[m])
        steps = args.steps_large if psi >= args.large_params else args.steps
        pred = n * predict_rank_bytes(s, m, n, bsz, seq, args.bucket_size or default_bucket,
                                      bool(args.ddp_grad_view))
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
        if args.wait_quiet > 0:  # the machine is shared: wait (bounded) for other work to end
            deadline = time.monotonic() + args.wait_quiet_max
            while os.getloadavg()[0] > args.wait_quiet and time.monotonic() < deadline:
                time.sleep(10)
        rfile = work / f"{tag}.json"
        cmd = ["mpiexec", "-n", str(n), sys.executable, "-m", "mpi4py", str(script),
               "--system", s, "--model", m, "--micro-batch", str(bsz), "--seq-len", str(seq),
               "--warmup", str(args.warmup), "--steps", str(steps), "--threads", str(args.threads),
               "--lr", str(args.lr), "--weight-decay", str(args.weight_decay),
               "--torch-adamw", args.torch_adamw, "--ddp-bucket-mb", str(args.ddp_bucket_mb),
               "--ddp-grad-view", str(args.ddp_grad_view), "--seed", str(args.seed),
               "--malloc-label", mal, "--out", str(rfile)]
        if args.bucket_size:
            cmd += ["--bucket-size", str(args.bucket_size)]
        if args.ds_zero:
            cmd += ["--ds-zero", args.ds_zero]
        env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
        env.update(RANK_ENV)
        env.update(MALLOC_ENVS[mal])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
        print(f"[driver] ({i + 1}/{len(plan)}) {tag}: predicted {pred / GiB:.1f} GiB", flush=True)
        t0 = time.monotonic()
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env=env, start_new_session=True)
        try:
            log, _ = p.communicate(timeout=args.run_timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)  # only the process group this driver started
            log, _ = p.communicate()
            p.returncode = "timeout"
        wall = time.monotonic() - t0
        (work / f"{tag}.log").write_text(log)
        if p.returncode == 0 and rfile.exists():
            run = json.loads(rfile.read_text())
            run["wall_s"] = wall
            run["predicted_total_bytes"] = pred
            doc["runs"].append(run)
            sys.stdout.write("".join(l + "\n" for l in log.splitlines() if l.startswith("[bench_dp]")))
        else:
            entry.update(returncode=p.returncode, wall_s=wall, log_tail=log[-3000:])
            doc["failed"].append(entry)
            print(f"[driver] FAILED {tag} (rc={p.returncode}); log {work / (tag + '.log')}\n"
                  f"{log[-1500:]}", flush=True)
        doc["total_wall_s"] = time.monotonic() - t_all
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, indent=1))  # after every run: partial results survive
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    print(f"[driver] wrote {out} ({len(doc['runs'])} runs, {len(doc['skipped'])} skipped, "
          f"{len(doc['failed'])} failed) in {doc.get('total_wall_s', 0):.0f}s", flush=True)
    if args.png:
        sys.path.insert(0, str(HERE))
        import plot_dp

        plot_dp.plot(doc, args.png)
        print(f"[driver] wrote {args.png}", flush=True)


def shape_of(args, model: str) -> tuple[int, int]:
    from zerompi.models.gpt import PRESETS

    bsz, seq = DEFAULT_SHAPES.get(model, (1, PRESETS[model].block_size))
    return args.micro_batch or bsz, args.seq_len or seq


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--driver", action="store_true", help="loop over runs (no MPI in this process)")
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
    ap.add_argument("--wait-quiet", type=float, default=0.0,
                    help="driver: before each run wait until the 1-min load average is below this (0: off)")
    ap.add_argument("--wait-quiet-max", type=float, default=600.0, help="driver: longest such wait, s")
    ap.add_argument("--work-dir", default=None, help="driver: per-run JSON and logs (default: a temp dir)")
    ap.add_argument("--out", required=True, help="JSON output (worker: one run; driver: merged)")
    ap.add_argument("--png", default=None, help="driver: plot file")
    args = ap.parse_args(argv)
    if args.driver:
        driver(args)
    else:
        parse_system(args.system)
        args.malloc_label = args.malloc_label or (
            "mmap128k" if os.environ.get("MALLOC_MMAP_THRESHOLD_") else "default")
        worker(args)


if __name__ == "__main__":
    main()
