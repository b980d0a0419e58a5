"""Read a DeepSpeed JSON config as a zerompi config (docs/migrating-from-deepspeed.md).

`zerompi.initialize(model, "ds_config.json")` and `python -m zerompi.train
--deepspeed_config ds_config.json` accept the file a DeepSpeed user already has. Keys
that map onto ours are translated; keys that only tune DeepSpeed's own machinery
(logging, overlap knobs we always do, parameter offload) are named together in ONE warning and
ignored; keys whose absence would change what is computed (another optimizer, an LR
scheduler, a static loss scale, L2-style Adam) are errors, because silently training a
different model is worse than stopping.
"""
from __future__ import annotations

import warnings
from typing import Any, Mapping

from .errors import ConfigError

# Top-level keys that mark a dict as a DeepSpeed config (none is a zerompi key; "fp16"
# and "optimizer" are both, so they mark only in DeepSpeed's shape).
_MARKERS = ("zero_optimization", "train_batch_size", "train_micro_batch_size_per_gpu", "bf16", "bfloat16",
            "steps_per_print", "zero_allow_untested_optimizer", "amp", "scheduler")
# DeepSpeed's activation_checkpointing keys ("activation_checkpointing" is a zerompi
# table too: it marks a DeepSpeed config only with these inside).
_AC_KEYS = {"partition_activations": "partition", "cpu_checkpointing": "cpu_offload",
            "contiguous_memory_optimization": "contiguous"}
_AC_IGNORED = {"number_checkpoints", "synchronize_checkpoint_boundary", "profile"}

# Ignored without changing the math: DeepSpeed's logging, profiling and engine knobs.
_IGNORED_TOP = {"steps_per_print", "wall_clock_breakdown", "dump_state", "tensorboard", "wandb",
                "csv_monitor", "comet", "flops_profiler", "comms_logger", "zero_allow_untested_optimizer",
                "zero_force_ds_cpu_optimizer", "memory_breakdown", "prescale_gradients",
                "gradient_predivide_factor", "sparse_gradients", "communication_data_type_sparse",
                "elasticity", "autotuning", "checkpoint", "aio", "compile", "seed"}
# zero_optimization knobs that zerompi always has (value True) or that only tune DeepSpeed.
_ZERO_ALWAYS = {"contiguous_gradients", "overlap_comm", "reduce_scatter", "allgather_partitions"}
_ZERO_IGNORED = {"allgather_bucket_size", "round_robin_gradients", "sub_group_size",
                 "stage3_gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save",
                 "stage3_max_reuse_distance", "elastic_checkpoint", "load_from_fp32_weights",
                 "ignore_unused_parameters", "legacy_stage1", "cpu_offload",
                 "offload_param", "zero_quantized_weights",
                 "zero_quantized_gradients", "use_multi_rank_bucket_allreduce",
                 "memory_efficient_linear", "stage3_module_granularity_threshold", "log_trace_cache_warnings"}


class DeepSpeedConfigWarning(UserWarning):
    """DeepSpeed config keys zerompi ignores (one warning names all of them)."""


def looks_like_deepspeed(data: Any) -> bool:
    if not isinstance(data, Mapping) or "stage" in data or "precision" in data:
        return False  # zerompi's own top-level keys
    fp16, opt, ac = data.get("fp16"), data.get("optimizer"), data.get("activation_checkpointing")
    return (any(k in data for k in _MARKERS)
            or (isinstance(ac, Mapping) and any(k in ac for k in (*_AC_KEYS, *_AC_IGNORED))) or (isinstance(fp16, Mapping) and "enabled" in fp16)
            or (isinstance(opt, Mapping) and ("type" in opt or "params" in opt)))


def _noop(v) -> bool:
    """A value that switches a DeepSpeed feature off: ignoring it changes nothing."""
    return v in (False, None, 0, "none") or v == {} or (isinstance(v, Mapping) and v.get("enabled") is False)


def _set(v) -> bool:
    return v is not None and v != "auto"  # transformers' DeepSpeed integration writes "auto"


def _int(key: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or int(v) != v:
        raise ConfigError(key, v, "expected an integer")
    return int(v)


def _precision(ds: Mapping, out: dict, ignored: list[str]) -> None:
    bf16, fp16 = ds.get("bf16") or {}, ds.get("fp16") or {}
    if "bfloat16" in ds:  # DeepSpeed's older spelling
        bf16 = ds["bfloat16"] or {}
    on = [name for name, blk in (("bf16", bf16), ("fp16", fp16)) if blk.get("enabled") is True]
    if len(on) == 2:
        raise ConfigError("bf16.enabled", True, "bf16 and fp16 are both enabled; choose one")
    if ds.get("amp", {}).get("enabled"):
        raise ConfigError("amp.enabled", True, "apex AMP is not supported; use bf16 or fp16 blocks")
    out["precision"] = on[0] if on else "fp32"
    if out["precision"] == "bf16":
        ignored += [f"bf16.{k}" for k in bf16 if k != "enabled"]
    if out["precision"] != "fp16":
        return  # a disabled block's settings have no effect in DeepSpeed either
    if fp16.get("loss_scale", 0):
        raise ConfigError("fp16.loss_scale", fp16["loss_scale"],
                          "a static loss scale is not supported (zerompi scales dynamically); "
                          "remove it or set it to 0")
    scale = {}
    if _set(fp16.get("initial_scale_power")):
        scale["initial_scale"] = 2.0 ** _int("fp16.initial_scale_power", fp16["initial_scale_power"])
    for ds_key, ours in (("loss_scale_window", "window"), ("hysteresis", "hysteresis"),
                         ("min_loss_scale", "min_scale")):
        if _set(fp16.get(ds_key)):
            scale[ours] = fp16[ds_key]
    out["fp16"] = scale
    ignored += [f"fp16.{k}" for k in fp16 if k not in ("enabled", "loss_scale", "initial_scale_power",
                                                      "loss_scale_window", "hysteresis", "min_loss_scale")]


def _optimizer(ds: Mapping, out: dict, ignored: list[str]) -> None:
    opt = ds.get("optimizer")
    if not opt:
        return
    kind = str(opt.get("type", "")).lower()
    params = dict(opt.get("params") or {})
    if kind not in ("adam", "adamw", "fusedadam", "cpuadam", "deepspeedcpuadam"):
        raise ConfigError("optimizer.type", opt.get("type"),
                          "zerompi trains with AdamW only; Adam/AdamW configs are translated")
    # DeepSpeed's "Adam" is decoupled AdamW unless adam_w_mode is false (L2 in the gradient).
    if params.pop("adam_w_mode", True) is False and params.get("weight_decay", 0):
        raise ConfigError("optimizer.params.adam_w_mode", False,
                          "Adam with L2 weight decay is not AdamW; zerompi has AdamW only")
    mapped = {}
    for k in ("lr", "betas", "eps", "weight_decay"):
        if _set(params.get(k)):
            mapped[k] = params.pop(k)
        else:
            params.pop(k, None)
    if params.pop("amsgrad", False):
        raise ConfigError("optimizer.params.amsgrad", True, "AMSGrad is not supported")
    ignored += [f"optimizer.params.{k}" for k in params]  # torch_adam, fused, bias_correction...
    out["optimizer"] = mapped


def _zero(ds: Mapping, out: dict, ignored: list[str]) -> None:
    z = ds.get("zero_optimization") or {}
    if _set(z.get("stage")):
        out["stage"] = _int("zero_optimization.stage", z["stage"])
    if _set(z.get("reduce_bucket_size")):
        out["bucket_size"] = _int("zero_optimization.reduce_bucket_size", z["reduce_bucket_size"])
    off = z.get("offload_optimizer")
    if isinstance(off, Mapping) and off.get("device", "none") not in ("none", None):
        if off["device"] != "cpu":  # nvme: the states would silently stay in memory
            raise ConfigError("zero_optimization.offload_optimizer.device", off["device"],
                              "zerompi offloads the optimizer to cpu only")
        out["offload_optimizer"] = "cpu"
        ignored += [f"zero_optimization.offload_optimizer.{k}" for k in off if k != "device"
                    and not _noop(off[k])]  # pin_memory, buffer_count...: tuning only
    s3 = {}
    if _set(z.get("stage3_param_persistence_threshold")):
        s3["persistence_threshold"] = _int("zero_optimization.stage3_param_persistence_threshold",
                                           z["stage3_param_persistence_threshold"])
    if _set(z.get("stage3_max_live_parameters")):
        s3["max_live_parameters"] = _int("zero_optimization.stage3_max_live_parameters",
                                         z["stage3_max_live_parameters"])
    if _set(z.get("stage3_prefetch_bucket_size")):
        # DeepSpeed prefetches by elements, zerompi by modules ahead (bounded by
        # max_live_parameters): 0 means no prefetch in both; any other size -> 1 module.
        n = _int("zero_optimization.stage3_prefetch_bucket_size", z["stage3_prefetch_bucket_size"])
        s3["prefetch_modules"] = 0 if n == 0 else 1
    _hierarchy(z, out, s3)
    if s3:
        out["stage3"] = s3
    for k, v in z.items():
        if k in ("stage", "reduce_bucket_size", "stage3_param_persistence_threshold",
                 "stage3_max_live_parameters", "stage3_prefetch_bucket_size", "offload_optimizer",
                 "zero_hpz_partition_size", "mics_shard_size"):
            continue
        if k in _ZERO_ALWAYS and v is not False:
            continue  # what zerompi does anyway
        if _noop(v) or (k in ("offload_optimizer", "offload_param") and v.get("device", "none") == "none"):
            continue
        ignored.append(f"zero_optimization.{k}")


def _hierarchy(z: Mapping, out: dict, s3: dict) -> None:
    """hpZ and MiCS: DeepSpeed's groups are consecutive ranks, as ours (zero/groups.py).
    zero_hpz_partition_size K > 1 -> stage3.secondary_partition = K (stage 3 only in both).
    mics_shard_size K > 0 -> shard_group = K at stage 3; DeepSpeed ignores it at stages
    1-2 (it shards over the world there), which our shard_group would not: refused."""
    if _set(z.get("zero_hpz_partition_size")):
        k = _int("zero_optimization.zero_hpz_partition_size", z["zero_hpz_partition_size"])
        if k < 1:
            raise ConfigError("zero_optimization.zero_hpz_partition_size", k, "must be >= 1 (1 = off)")
        if k > 1:
            s3["secondary_partition"] = k
    if _set(z.get("mics_shard_size")):
        k = _int("zero_optimization.mics_shard_size", z["mics_shard_size"])
        if k > 0 and out.get("stage", 0) != 3:
            raise ConfigError("zero_optimization.mics_shard_size", k,
                              "DeepSpeed applies MiCS at stage 3 only (stages 1-2 shard over all ranks "
                              "there); set stage 3, or zerompi's zero.shard_group for hybrid stages 1-2")
        if k > 0:
            out["shard_group"] = k


def _activation_checkpointing(ds: Mapping, out: dict, ignored: list[str]) -> None:
    """partition_activations / cpu_checkpointing / contiguous_memory_optimization switch
    on our activation_checkpointing (DeepSpeed checkpoints where the model calls
    deepspeed.checkpointing.checkpoint; zerompi checkpoints the model's repeated blocks)."""
    ac = ds.get("activation_checkpointing") or {}
    mapped = {}
    for k, v in ac.items():
        if k in _AC_KEYS:
            if not isinstance(v, bool):
                raise ConfigError(f"activation_checkpointing.{k}", v, "expected true or false")
            mapped[_AC_KEYS[k]] = v
        elif v not in (False, None, 0):
            ignored.append(f"activation_checkpointing.{k}" + ("" if k in _AC_IGNORED else " (unknown to zerompi)"))
    if any(mapped.values()):
        out["activation_checkpointing"] = {"enabled": True, **mapped}


def _batch(ds: Mapping, out: dict, world_size) -> dict:
    """gradient_accumulation_steps and the global batch, as DeepSpeed derives them:
    train_batch_size = micro_batch_per_gpu * gradient_accumulation_steps * world size."""
    tb, mb, ga = (ds.get(k) for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                      "gradient_accumulation_steps"))
    tb, mb, ga = (_int(k, v) if _set(v) else None for k, v in
                  (("train_batch_size", tb), ("train_micro_batch_size_per_gpu", mb),
                   ("gradient_accumulation_steps", ga)))
    if ga is None and tb is not None and mb is not None:
        ws = world_size() if callable(world_size) else world_size
        if tb % (mb * ws):
            raise ConfigError("train_batch_size", tb, f"is not train_micro_batch_size_per_gpu {mb} x "
                              f"gradient_accumulation_steps x {ws} ranks")
        ga = tb // (mb * ws)
    if ga is not None:
        out["gradient_accumulation_steps"] = ga
    if tb is not None and mb is not None and ga is not None:
        ws = world_size() if callable(world_size) else world_size
        if tb != mb * ga * ws:
            raise ConfigError("train_batch_size", tb, f"!= train_micro_batch_size_per_gpu {mb} x "
                              f"gradient_accumulation_steps {ga} x {ws} ranks (DeepSpeed rejects it too)")
    if tb is None and mb is not None:
        ws = world_size() if callable(world_size) else world_size
        tb = mb * (ga or 1) * ws
    return {"global_batch": tb} if tb is not None else {}


def _world_size() -> int:
    from .. import runtime

    return runtime.init().Get_size()


def translate(ds: Mapping, world_size=_world_size) -> tuple[dict, dict, list[str]]:
    """(ZeroConfig dict, trainer settings {global_batch}, ignored DeepSpeed keys).
    Raises ConfigError (naming the DeepSpeed key) where ignoring a key changes the math."""
    out: dict = {}
    ignored: list[str] = []
    _precision(ds, out, ignored)
    _optimizer(ds, out, ignored)
    _zero(ds, out, ignored)
    if _set(ds.get("gradient_clipping")):
        out["gradient_clipping"] = float(ds["gradient_clipping"])
    if ds.get("scheduler"):
        raise ConfigError("scheduler.type", ds["scheduler"].get("type"),
                          "zerompi has no LR scheduler object: set engine.param_groups[i]['lr'] in "
                          "your loop (python -m zerompi.train: warmup_steps, lr_decay_steps, min_lr)")
    types = ds.get("data_types") or {}
    if types.get("grad_accum_dtype") in ("fp32", "float32"):
        out["grad_accum_dtype"] = "fp32"
    ignored += [f"data_types.{k}" for k in types if k != "grad_accum_dtype"]
    comm = ds.get("communication_data_type")
    if comm is not None:
        out["reduce_dtype"] = "fp32" if comm in ("fp32", "float32") else "param"
    _activation_checkpointing(ds, out, ignored)
    trainer = _batch(ds, out, world_size)
    known = {"bf16", "bfloat16", "fp16", "amp", "optimizer", "zero_optimization", "gradient_clipping",
             "scheduler", "data_types", "communication_data_type", "activation_checkpointing",
             "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"}
    for k, v in ds.items():
        if k not in known and not (k in _IGNORED_TOP and _noop(v)):
            ignored.append(k if k in _IGNORED_TOP else f"{k} (unknown to zerompi)")
    return out, trainer, ignored


def _rank0() -> bool:
    import sys

    MPI = sys.modules.get("mpi4py.MPI")
    try:
        return MPI is None or not MPI.Is_initialized() or MPI.COMM_WORLD.Get_rank() == 0
    except Exception:
        return True


def warn_ignored(ignored: list[str], source: str = "DeepSpeed config", cli: str | None = None) -> None:
    """One warning, rank 0 only, naming every ignored key; a command line (`cli` = its
    name) gets a plain stderr line instead of Python's warning format."""
    if not ignored or not _rank0():
        return
    msg = (f"{source}: zerompi ignores {len(ignored)} key(s) that do not change the math: "
           f"{', '.join(ignored)} (docs/migrating-from-deepspeed.md)")
    if cli:
        import sys

        print(f"{cli}: warning: {msg}", file=sys.stderr, flush=True)
    else:
        warnings.warn(msg, DeepSpeedConfigWarning, stacklevel=3)


def merge_into_train_config(base: dict, ds: Mapping, source: str) -> dict:
    """`python -m zerompi.train --deepspeed_config`: the DeepSpeed file replaces the zero
    table's keys it sets and global_batch; the rest of `base` (--config) stays."""
    try:
        zero, trainer, ignored = translate(ds)
    except ConfigError as e:
        raise e.under("deepspeed_config") from None
    warn_ignored(ignored, source, cli="zerompi.train")
    out = dict(base)
    merged = dict(out.get("zero") or {})
    for k, v in zero.items():
        merged[k] = dict(merged.get(k) or {}, **v) if isinstance(v, dict) else v
    out["zero"] = merged
    out.update(trainer)
    return out


def zero_config_dict(ds: Mapping, source: str = "DeepSpeed config") -> dict:
    """The ZeroConfig dict for a DeepSpeed config, after warning about ignored keys."""
    out, _, ignored = translate(ds)
    warn_ignored(ignored, source)
    return out
