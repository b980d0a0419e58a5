"""The systems the data-parallel benchmark compares, built on one rank: zerompi stages 0-3,
torch DDP, ZeroRedundancyOptimizer, FSDP2 and DeepSpeed ZeRO (see bench_dp.py).
"""
from __future__ import annotations

import datetime as _dt
import os
import sys
import warnings

from harness import jsonable, nbytes, current_rss, free_port

SYSTEMS = ("zerompi-0", "zerompi-1", "zerompi-2", "zerompi-3", "ddp", "torch-zero", "fsdp2",
           "deepspeed-3")
OPTIONAL_SYSTEMS = ("deepspeed-1", "deepspeed-2", "zerompi-0-bf16", "zerompi-1-bf16",
                    "zerompi-2-bf16", "zerompi-3-bf16")


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


def _torch_dist_env(comm) -> None:
    """torch.distributed (and DeepSpeed) get rank/world from MPI; rank 0 picks the port."""
    port = comm.bcast(free_port() if comm.Get_rank() == 0 else None, root=0)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      RANK=str(comm.Get_rank()), WORLD_SIZE=str(comm.Get_size()),
                      LOCAL_RANK=str(comm.Get_rank()), LOCAL_WORLD_SIZE=str(comm.Get_size()))


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
        engine = zerompi.initialize(model, cfg)

        def step():
            engine.step()

        def info():
            rep = engine.memory_report()
            return {"memory_report": rep, "model_states_bytes": rep["model_states"],
                    "comm_stats": jsonable(engine.comm_stats()),
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

    if kind == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (comm.Get_size(),))
        # one FSDP unit per transformer block, the root takes the rest (embeddings,
        # tied head, final norm); defaults: reshard after forward, fp32 throughout
        for blk in model.h:
            fully_shard(blk, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), **opt_kw)

        def step():
            opt.step()
            opt.zero_grad()

        def info():
            locs = [p.to_local() for p in model.parameters()]
            pbytes = sum(nbytes(t) for t in locs)
            obytes = sum(nbytes(t.to_local() if hasattr(t, "to_local") else t)
                         for st in opt.state.values() for t in st.values() if torch.is_tensor(t))
            return {"memory_report": {"params": pbytes, "optimizer": obytes,
                                      "note": "sharded params + optimizer state; sharded grads "
                                              "(4*Psi/N) are freed by zero_grad and added here"},
                    "model_states_bytes": 2 * pbytes + obytes}

        return model, lambda loss: loss.backward(), step, info, dist.destroy_process_group

    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(model, gradient_as_bucket_view=True)  # DDP's default 25 MB buckets
    if kind == "ddp":
        opt = torch.optim.AdamW(ddp.parameters(), **opt_kw)
        local_opt = opt
    else:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW,
                                      **opt_kw)
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
                "ddp_gradient_as_bucket_view": True}

    return ddp, lambda loss: loss.backward(), step, info, dist.destroy_process_group


def deepspeed_config(args, stage: int, bsz: int, n: int) -> dict:
    """fp32 DeepSpeed config with the benchmark's AdamW (torch's implementation, so no
    C++ op is built) and communication buckets of zerompi's size at n ranks."""
    bucket = args.bucket_size or default_bucket(n, stage)
    zero = {"stage": stage, "reduce_bucket_size": bucket}
    if stage < 3:
        zero["allgather_bucket_size"] = bucket
    return {
        "train_micro_batch_size_per_gpu": bsz, "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0, "steps_per_print": 1 << 30, "wall_clock_breakdown": False,
        "optimizer": {"type": "AdamW", "params": {
            "lr": args.lr, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": args.weight_decay,
            "torch_adam": True}},
        "zero_optimization": zero,
    }


def default_bucket(n: int, stage: int = 2, precision: str = "fp32") -> int:
    """Elements per bucket of zerompi's default bucket_size at n ranks on a CPU ("auto"
    resolves with n: zero/buckets.py); DeepSpeed gets the same."""
    from zerompi.config import ZeroConfig
    from zerompi.zero import layout

    return layout.bucket(ZeroConfig(), n, stage, precision)[0]


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
    cfg = deepspeed_config(args, stage, bsz, comm.Get_size())
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
        # params (stage 3: their partitions), fp32 partition copies, gradient partitions
        # and AdamW state, each storage once (ds_tensor are views into the flat groups);
        # after the step, so stages 1-2 show no gradients (freed)
        found = [getattr(p, "ds_tensor", None) if stage == 3 else p.data for p in model.parameters()]
        for name in ("fp16_partitioned_groups_flat", "fp32_partitioned_groups_flat",
                     "single_partition_of_fp32_groups", "averaged_gradients",
                     "grad_partitions_flat_buffer", "bit16_groups_flat"):
            v = getattr(opt, name, None)
            for t in (v.values() if isinstance(v, dict) else v if isinstance(v, (list, tuple)) else [v]):
                found += t if isinstance(t, (list, tuple)) else [t]
        found += [t for st in getattr(opt, "optimizer", opt).state.values() for t in st.values()]
        total = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                     for t in found if torch.is_tensor(t) and t.numel()}.values())
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

