"""The one table of DeepSpeed config keys: for every key zerompi knows, whether it is
mapped (onto what), ignored (because it does not change the trained model) or refused
when switched on (and why), with DeepSpeed's default. translation.py translates by
it; docs/migrating-from-deepspeed.md's key table is generated from it
(`python -m zerompi.config.deepspeed.keys`, checked by tests/unit/test_ds_config.py).

Defaults and meanings are DeepSpeed's as of DS_VERSION (its runtime/config.py,
constants.py, zero/config.py, precision_config.py, lr_schedules.py and ops/adam).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

DS_VERSION = "0.19.6"
MAP, IGNORE, REFUSE = "mapped", "ignored", "refused"
ABSENT = object()  # no plain default: DeepSpeed derives it (doc_default says how)


@dataclass(frozen=True)
class Key:
    key: str              # dotted as in ds_config.json; "block.*" = any other key of that block
    action: str           # MAP | IGNORE | REFUSE
    what: str             # MAP: the zerompi setting; IGNORE / REFUSE: why
    default: Any = ABSENT  # DeepSpeed's default; the translator applies it where it maps the key
    doc_default: str = ""  # how DeepSpeed derives the default when there is no plain value
    allowed: tuple = ()   # REFUSE: values that leave the feature off (else: false/0/none/{}/enabled false)
    quiet: bool = False   # IGNORE: what zerompi always does; not named in the notice

    def refuses(self, value) -> bool:
        if self.action != REFUSE:
            return False
        if self.allowed:  # true and 1 are not the same setting here (sequence_parallel_size: true is no size)
            return not any(value is a if isinstance(value, bool) or isinstance(a, bool) else value == a
                           for a in self.allowed)
        return switched_on(value)


def switched_on(value) -> bool:
    """False for a value that turns a DeepSpeed feature off: false, 0, null, "none", {},
    or a block whose every "enabled" (at any depth) is false; a block without any
    "enabled" is on when it is not empty (sparse_attention, weight_quantization)."""
    if isinstance(value, Mapping):
        flags = list(_enabled_flags(value))
        return any(switched_on(f) for f in flags) if flags else bool(value)
    return not (value is None or value is False or value == 0 or value in ("none", "") or value == [])


def _enabled_flags(block: Mapping):
    for k, v in block.items():
        if k == "enabled":
            yield v
        elif isinstance(v, Mapping):
            yield from _enabled_flags(v)


_LOG = "logging, profiling or monitoring only"
_Z3 = "tunes DeepSpeed's stage-3 fetching; zerompi gathers by units (stage3.*); same math"
_OFF = "offload tuning; zerompi offloads the optimizer to pinned host memory its own way; same math"
_SEQ = ("DeepSpeed (Ulysses) splits each sequence over sequence_parallel_size ranks, which share one micro-batch, "
        "and divides the data-parallel ranks by it; zerompi has no sequence parallelism")
_ZPP = "ZeRO++ quantized communication changes the values trained on; zerompi communicates exactly"

_TABLE = [
    # -- batch --------------------------------------------------------------------------
    Key("train_batch_size", MAP, "trainer global_batch; with the other two as DeepSpeed: train_batch_size = "
        "micro x accumulation x data-parallel ranks (ranks / zero.tensor_parallel_size), inconsistent values refused",
        doc_default="micro x accumulation x data-parallel ranks"),
    Key("train_micro_batch_size_per_gpu", MAP, "with train_batch_size: derives gradient_accumulation_steps",
        doc_default="train_batch_size / (accumulation x data-parallel ranks)"),
    Key("gradient_accumulation_steps", MAP, "gradient_accumulation_steps",
        doc_default="derived; 1 when only one batch size is given"),
    Key("managed_gradient_accumulation", REFUSE, "engine.step() counts micro-steps and updates every "
        "gradient_accumulation_steps-th call (DeepSpeed's true); false (step() only at the boundary) is not supported",
        True, allowed=(True,)),
    # -- precision ----------------------------------------------------------------------
    Key("bf16.enabled", MAP, 'precision = "bf16" (fp32 master weights and moments); "auto": the run\'s precision', False),
    Key("bf16.immediate_grad_update", IGNORE, "when the update is applied, not what it is", False),
    Key("bf16.check_grad_overflow", IGNORE, "zerompi always skips a non-finite step (and stops after "
        "zero.max_nonfinite_steps in a row)", True),
    Key("bf16.bf16_master_weights_and_grads", REFUSE, "bf16 master weights round every update; zerompi keeps "
        "fp32 master weights", False),
    Key("bf16.bf16_optimizer_states", REFUSE, "bf16 Adam moments; zerompi keeps them in fp32", False),
    Key("fp16.enabled", MAP, 'precision = "fp16" with dynamic loss scaling; "auto": the run\'s precision', False),
    Key("fp16.loss_scale", REFUSE, "a static loss scale; zerompi scales dynamically (0)", 0, allowed=(0,)),
    Key("fp16.initial_scale_power", MAP, "fp16.initial_scale = 2**power", 16),
    Key("fp16.loss_scale_window", MAP, "fp16.window", 1000),
    Key("fp16.hysteresis", MAP, "fp16.hysteresis", 2),
    Key("fp16.min_loss_scale", MAP, "fp16.min_scale", 1),
    Key("fp16.consecutive_hysteresis", REFUSE, "refilling the hysteresis after good steps changes which steps "
        "are skipped; zerompi does not refill", False),
    Key("fp16.auto_cast", REFUSE, "zerompi does not cast a forward's floating-point inputs to fp16", False),
    Key("fp16.fp16_master_weights_and_grads", REFUSE, "fp16 master weights; zerompi keeps fp32 master weights",
        False),
    Key("amp.enabled", REFUSE, "apex AMP is another mixed-precision scheme; use the bf16 or fp16 block", False),
    Key("amp.*", IGNORE, "apex options, used only with amp.enabled"),
    Key("torch_autocast.enabled", REFUSE, "torch.autocast keeps fp32 parameters; zerompi trains bf16/fp16 "
        "parameters with fp32 master weights (the bf16/fp16 blocks)", False),
    Key("torch_autocast.*", IGNORE, "used only with torch_autocast.enabled"),
    Key("communication_data_type", MAP, 'reduce_dtype: "fp32", or "param" for the parameters\' dtype',
        doc_default="the parameters' dtype"),
    Key("data_types.grad_accum_dtype", MAP, 'grad_accum_dtype: "fp32", or "param" for the parameters\' dtype',
        doc_default="the parameters' dtype"),
    Key("data_types.param_dtype", MAP, "checked: must be the bf16/fp16 block's dtype (DeepSpeed checks it too)",
        doc_default="the bf16/fp16 block's dtype"),
    Key("data_types.buffer_dtype", MAP, 'buffer_dtype: "fp32", or "param" for the parameters\' dtype',
        doc_default="buffers keep their dtype (buffer_dtype keep)"),
    Key("seq_parallel_communication_data_type", IGNORE, "used only with sequence parallelism", "fp32"),
    # -- optimizer ----------------------------------------------------------------------
    Key("optimizer.type", MAP, "Adam / AdamW (any case): zerompi's AdamW; SGD / Adagrad: torch's, over the "
        "shard (optimizer.type sgd / adagrad); any other optimizer is refused",
        doc_default="none: the client's optimizer (here: --config's)"),
    Key("optimizer.params.lr", MAP, "optimizer.lr", 1e-3),
    Key("optimizer.params.betas", MAP, "optimizer.betas", (0.9, 0.999)),
    Key("optimizer.params.eps", MAP, "optimizer.eps", 1e-8),
    Key("optimizer.params.weight_decay", MAP, "optimizer.weight_decay (decoupled, as DeepSpeed's Adam with "
        "adam_w_mode and AdamW)", doc_default="0; 0.01 with torch_adam (torch.optim.AdamW's)"),
    Key("optimizer.params.adam_w_mode", MAP, 'decoupled weight decay (true); false with type "Adam" and weight '
        "decay (L2 in the gradient) is refused", True),
    Key("optimizer.params.torch_adam", MAP, "the weight_decay default (torch.optim.AdamW's 0.01); otherwise "
        "only the implementation", False),
    Key("optimizer.params.momentum", MAP, "optimizer.momentum (SGD)", 0.0),
    Key("optimizer.params.dampening", MAP, "optimizer.dampening (SGD)", 0.0),
    Key("optimizer.params.nesterov", MAP, "optimizer.nesterov (SGD)", False),
    Key("optimizer.params.lr_decay", MAP, "optimizer.lr_decay (Adagrad)", 0.0),
    Key("optimizer.params.initial_accumulator_value", MAP, "optimizer.initial_accumulator_value (Adagrad)", 0.0),
    Key("optimizer.params.bias_correction", REFUSE, "Adam without bias correction; zerompi always corrects",
        True, allowed=(True,)),
    Key("optimizer.params.amsgrad", REFUSE, "AMSGrad is not implemented", False),
    Key("optimizer.params.maximize", REFUSE, "maximizing is not implemented", False),
    Key("optimizer.params.fp32_optimizer_states", REFUSE, "CPU Adam moments below fp32; zerompi keeps fp32",
        True, allowed=(True,)),
    Key("optimizer.params.max_grad_norm", REFUSE, "DeepSpeed rejects it too: use gradient_clipping"),
    Key("optimizer.params.set_grad_none", IGNORE, "how gradients are freed", True),
    Key("optimizer.params.foreach", IGNORE, "torch_adam's implementation choice"),
    Key("optimizer.params.fused", IGNORE, "torch_adam's implementation choice"),
    Key("optimizer.params.capturable", IGNORE, "torch_adam's implementation choice"),
    Key("optimizer.params.differentiable", IGNORE, "torch_adam's implementation choice"),
    Key("optimizer.legacy_fusion", IGNORE, "implementation choice", False),
    Key("zero_allow_untested_optimizer", IGNORE, "a DeepSpeed safety switch for client optimizers", False, quiet=True),
    Key("zero_force_ds_cpu_optimizer", IGNORE, "which CPU Adam implementation DeepSpeed uses", True, quiet=True),
    Key("gradient_clipping", MAP, "gradient_clipping (global L2 norm; 0 = none)", 1.0,
        doc_default="1.0 (DeepSpeed >= 0.19.3; 0 = none before)"),
    Key("gradient_allreduce_op", REFUSE, '"sum" adds the ranks\' gradients instead of averaging them', "mean",
        allowed=("mean",)),
    Key("prescale_gradients", IGNORE, "divides before instead of after the reduction: the same mean", False),
    Key("gradient_predivide_factor", IGNORE, "splits the division around the reduction: the same mean", 1.0),
    Key("sparse_gradients", IGNORE, "the communication format of embedding gradients", False),
    # -- scheduler: zerompi.initialize builds it (engine.lr_scheduler, optim/ds_schedules.py, every
    # parameter with DeepSpeed's meaning); python -m zerompi.train maps it onto its lr_schedule --
    Key("scheduler.type", MAP, "zerompi.initialize: WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle as "
        "DeepSpeed builds them (engine.lr_scheduler, stepped after each applied update). The trainer: "
        "WarmupLR -> deepspeed_warmup, WarmupDecayLR -> deepspeed_warmup_decay, WarmupCosineLR -> "
        "deepspeed_warmup_cosine, \"auto\" params filled with the run's numbers (as the HF integration does); "
        "OneCycle refused there. LRRangeTest refused", doc_default="none: constant lr"),
    Key("scheduler.params.warmup_min_lr", MAP, "WarmupLR/WarmupDecayLR's; trainer: warmup_start_lr", 0.0),
    Key("scheduler.params.warmup_max_lr", MAP, "WarmupLR/WarmupDecayLR's peak; trainer: optimizer.lr",
        doc_default="WarmupLR: the optimizer's lr; WarmupDecayLR: 0.001"),
    Key("scheduler.params.warmup_num_steps", MAP, "as DeepSpeed (at least 2); trainer: warmup_steps", 1000),
    Key("scheduler.params.warmup_type", MAP, "log or linear; trainer: warmup_type", "log"),
    Key("scheduler.params.total_num_steps", MAP, "WarmupDecayLR/WarmupCosineLR's; trainer: lr_decay_steps",
        doc_default="required by WarmupDecayLR and WarmupCosineLR"),
    Key("scheduler.params.warmup_min_ratio", MAP, "WarmupCosineLR's; trainer: warmup_start_lr = ratio x lr", 0.0),
    Key("scheduler.params.cos_min_ratio", MAP, "WarmupCosineLR's; trainer: min_lr = ratio x lr", 1e-4),
    Key("scheduler.params.last_batch_iteration", MAP, "-1 only (a schedule starting mid-way is refused)", -1),
    Key("scheduler.params.cycle_min_lr", MAP, "OneCycle's (zerompi.initialize)", doc_default="required"),
    Key("scheduler.params.cycle_max_lr", MAP, "OneCycle's (zerompi.initialize)", doc_default="required"),
    Key("scheduler.params.decay_lr_rate", MAP, "OneCycle's (zerompi.initialize)", 0.0),
    Key("scheduler.params.cycle_first_step_size", MAP, "OneCycle's (zerompi.initialize)", 2000),
    Key("scheduler.params.cycle_second_step_size", MAP, "OneCycle's (zerompi.initialize)",
        doc_default="cycle_first_step_size"),
    Key("scheduler.params.cycle_first_stair_count", MAP, "OneCycle's (zerompi.initialize)", 0),
    Key("scheduler.params.cycle_second_stair_count", MAP, "OneCycle's (zerompi.initialize)",
        doc_default="cycle_first_stair_count"),
    Key("scheduler.params.decay_step_size", MAP, "OneCycle's (zerompi.initialize)", 0),
    Key("scheduler.params.cycle_momentum", MAP, "OneCycle's: cycles betas[0] (and sets betas[1] 0.99, as "
        "DeepSpeed)", True),
    Key("scheduler.params.cycle_min_mom", MAP, "OneCycle's (zerompi.initialize)", 0.8),
    Key("scheduler.params.cycle_max_mom", MAP, "OneCycle's (zerompi.initialize)", 0.9),
    Key("scheduler.params.decay_mom_rate", MAP, "OneCycle's (zerompi.initialize)", 0.0),
    # -- ZeRO ---------------------------------------------------------------------------
    Key("zero_optimization.stage", MAP, "stage (0-3, same meaning)", 0),
    Key("zero_optimization.reduce_bucket_size", MAP, "the largest bucket_size whose reduction buffers take no "
        "more memory than DeepSpeed's buffers of this many elements; ignored at stage 0, where DeepSpeed does not "
        "use it", 500_000_000),
    Key("zero_optimization.overlap_comm", MAP, "zerompi always overlaps; read for reduce_bucket_size's memory "
        "(DeepSpeed double-buffers with it at stages 1-2)", doc_default="true at stage 3, else false"),
    Key("zero_optimization.contiguous_gradients", IGNORE, "zerompi always reduces through contiguous buckets",
        True, quiet=True),
    Key("zero_optimization.reduce_scatter", IGNORE, "zerompi always reduce-scatters at stages 1-3", True, quiet=True),
    Key("zero_optimization.allgather_partitions", IGNORE, "zerompi always all-gathers", True, quiet=True),
    Key("zero_optimization.allgather_bucket_size", IGNORE, "zerompi all-gathers the blocks it reduces "
        "(bucket_size)", 500_000_000),
    Key("zero_optimization.use_multi_rank_bucket_allreduce", IGNORE, "a collective choice; same sums", True),
    Key("zero_optimization.round_robin_gradients", IGNORE, "a memory layout choice; same math", False),
    Key("zero_optimization.offload_optimizer.device", MAP, 'offload_optimizer = "cpu"; "nvme" is refused', "none"),
    Key("zero_optimization.offload_optimizer.*", IGNORE, _OFF),
    Key("zero_optimization.cpu_offload", MAP, 'offload_optimizer = "cpu" (DeepSpeed\'s older spelling)', False),
    Key("zero_optimization.offload_param.device", IGNORE, "zerompi keeps parameters in the rank's memory; "
        "same math", "none"),
    Key("zero_optimization.offload_param.*", IGNORE, _OFF),
    Key("zero_optimization.cpu_offload_param", IGNORE, "older spelling of offload_param", False),
    Key("zero_optimization.cpu_offload_use_pin_memory", IGNORE, _OFF, False),
    Key("zero_optimization.sub_group_size", IGNORE, "offload tiling; same math", 1_000_000_000),
    Key("zero_optimization.stage3_prefetch_bucket_size", MAP, "stage3.prefetch_modules: 0 = none, else 1 module "
        "(zerompi prefetches whole units, bounded by max_live_parameters)", 50_000_000),
    Key("zero_optimization.stage3_param_persistence_threshold", MAP, "stage3.persistence_threshold", 100_000),
    Key("zero_optimization.stage3_max_live_parameters", MAP, "stage3.max_live_parameters", 1_000_000_000),
    Key("zero_optimization.stage3_model_persistence_threshold", IGNORE, _Z3, doc_default="sys.maxsize"),
    Key("zero_optimization.stage3_max_reuse_distance", IGNORE, _Z3, 1_000_000_000),
    Key("zero_optimization.stage3_module_granularity_threshold", IGNORE, _Z3, 0),
    Key("zero_optimization.stage3_use_all_reduce_for_fetch_params", IGNORE, _Z3, False),
    Key("zero_optimization.stage3_allgather_sequential", IGNORE, _Z3, False),
    Key("zero_optimization.leaf_module", IGNORE, _Z3, doc_default="{}"),
    Key("zero_optimization.stage3_gather_16bit_weights_on_model_save", IGNORE, "zerompi checkpoints fp32; "
        "python -m zerompi.export writes full weights", False),
    Key("zero_optimization.stage3_gather_fp16_weights_on_model_save", IGNORE, "older spelling of "
        "stage3_gather_16bit_weights_on_model_save", False),
    Key("zero_optimization.ignore_unused_parameters", IGNORE, "zerompi handles unused parameters", True),
    Key("zero_optimization.load_from_fp32_weights", IGNORE, "zerompi checkpoints hold fp32 weights", True),
    Key("zero_optimization.elastic_checkpoint", IGNORE, "zerompi checkpoints load at any world size", False),
    Key("zero_optimization.legacy_stage1", IGNORE, "an older stage-1 implementation; same math", False),
    Key("zero_optimization.zero_hpz_partition_size", MAP, "stage3.secondary_partition = K (ZeRO++ hpZ: backward "
        "re-gathers inside groups of K consecutive ranks; 1 = off)", 1),
    Key("zero_optimization.mics_shard_size", MAP, "shard_group = K at stage 3 (MiCS; -1 = off); refused below "
        "stage 3, where DeepSpeed ignores it and shards over every rank", -1),
    Key("zero_optimization.mics_hierarchical_params_gather", IGNORE, "MiCS gathering; same math", False),
    Key("zero_optimization.zero_quantized_weights", REFUSE, _ZPP, False),
    Key("zero_optimization.zero_quantized_nontrainable_weights", REFUSE, _ZPP, False),
    Key("zero_optimization.zero_quantized_gradients", REFUSE, _ZPP, False),
    Key("zero_optimization.zeropp_loco_param", REFUSE, _ZPP, None),
    Key("zero_optimization.zenflow", REFUSE, "ZenFlow updates unimportant gradients asynchronously (stale)",
        None, allowed=(None,)),
    Key("zero_optimization.memory_efficient_linear", IGNORE, "stage-3 memory detail; same math", True),
    Key("zero_optimization.pipeline_loading_checkpoint", IGNORE, "checkpoint loading", False),
    Key("zero_optimization.override_module_apply", IGNORE, "stage-3 module.apply detail", True),
    Key("zero_optimization.log_trace_cache_warnings", IGNORE, _LOG, False),
    Key("zero_optimization.enable_sanity_checks", IGNORE, "debug checks", False),
    Key("zero_optimization.save_muon_momentum_buffer_in_memory", IGNORE, "Muon only (refused)", False),
    # -- activation checkpointing ----------------------------------------------------------
    Key("activation_checkpointing.partition_activations", MAP, "activation_checkpointing.enabled + partition",
        False),
    Key("activation_checkpointing.cpu_checkpointing", MAP, "activation_checkpointing.enabled + cpu_offload", False),
    Key("activation_checkpointing.contiguous_memory_optimization", MAP,
        "activation_checkpointing.enabled + contiguous", False),
    Key("activation_checkpointing.number_checkpoints", IGNORE, "zerompi checkpoints every block", None),
    Key("activation_checkpointing.synchronize_checkpoint_boundary", IGNORE, "a device sync", False),
    Key("activation_checkpointing.profile", IGNORE, _LOG, False),
    # -- parallelism ------------------------------------------------------------------------
    Key("sequence_parallel_size", REFUSE, _SEQ, 1, allowed=(1, None)),
    Key("tensor_parallel.autotp_size", REFUSE, "AutoTP splits the model's layers itself; zerompi needs a "
        "tensor-parallel model (zero.tensor_parallel_size; python -m zerompi.train splits its GPT)", 0,
        allowed=(0, 1, None)),
    Key("tensor_parallel.*", IGNORE, "AutoTP options, used only with autotp_size > 1"),
    Key("expert_parallel", REFUSE, "AutoEP replaces the model's MoE layers and their routing settings", None),
    Key("pipeline", IGNORE, "pipeline-engine options (a PipelineModule is not supported)"),
    Key("elasticity", REFUSE, "elastic training overrides the batch keys", None),
    # -- features that change what is trained ------------------------------------------------
    Key("compression_training", REFUSE, "quantization / pruning / layer reduction change the model", None),
    Key("quantize_training", REFUSE, "MoQ quantizes the weights during training", None),
    Key("weight_quantization", REFUSE, "quantized weights", None),
    Key("data_efficiency", REFUSE, "data sampling / routing change what each step trains on", None),
    Key("curriculum_learning", REFUSE, "the curriculum changes what each step trains on", None),
    Key("progressive_layer_drop", REFUSE, "layers are skipped during training", None),
    Key("sparse_attention", REFUSE, "sparse attention is another model", None),
    # -- ignored: logging, profiling, tooling -------------------------------------------------
    *(Key(k, IGNORE, _LOG, d) for k, d in (
        ("steps_per_print", None), ("wall_clock_breakdown", False), ("memory_breakdown", False),
        ("dump_state", False), ("tensorboard", None), ("wandb", None), ("csv_monitor", None), ("comet", None),
        ("flops_profiler", None), ("comms_logger", None), ("timers", None), ("log_level", None))),
    Key("eigenvalue", IGNORE, "computes Hessian eigenvalues for quantize_training's schedule (refused); "
        "alone it changes nothing", None),
    Key("autotuning", IGNORE, "DeepSpeed's autotuner (a launcher feature)", None),
    Key("checkpoint", IGNORE, "DeepSpeed's checkpoint I/O options", None),
    Key("nebula", IGNORE, "DeepSpeed's checkpoint service", None),
    Key("datastates", IGNORE, "DeepSpeed's checkpoint engine", None),
    Key("aio", IGNORE, "NVMe I/O tuning (nvme offload is refused)", None),
    Key("compile", IGNORE, "torch.compile / DeepCompile; same math", None),
    Key("graph_harvesting", IGNORE, "CUDA graph capture; same math", False),
    Key("hybrid_engine", IGNORE, "generation kernels for RLHF; training math unchanged", None),
    Key("disable_allgather", IGNORE, "an older collective choice; same math", False),
    Key("dataloader_drop_last", IGNORE, "DeepSpeed's data loader (zerompi.train samples its own batches)", False),
    Key("vocabulary_size", IGNORE, "only checked for tensor-core alignment (a warning)", None),
    Key("use_data_before_expert_parallelism", IGNORE, "expert-parallel layout (no expert parallelism)", False),
]
TABLE: dict[str, Key] = {k.key: k for k in _TABLE}
assert len(TABLE) == len(_TABLE), "a key is listed twice"

# Another spelling DeepSpeed accepts for the same key (pydantic aliases, older names).
ALIASES = {f"zero_optimization.{k}": f"zero_optimization.stage3_{k}" for k in (
    "prefetch_bucket_size", "param_persistence_threshold", "max_live_parameters", "model_persistence_threshold",
    "max_reuse_distance", "module_granularity_threshold", "use_all_reduce_for_fetch_params",
    "allgather_sequential", "gather_16bit_weights_on_model_save")}
ALIASES.update({"bfloat16." + k[5:]: k for k in TABLE if k.startswith("bf16.")})
# Dict-valued keys whose own keys are looked up (the other dict values are one key each).
BLOCKS = {"zero_optimization", "zero_optimization.offload_optimizer", "zero_optimization.offload_param",
          "fp16", "bf16", "bfloat16", "amp", "torch_autocast", "optimizer", "optimizer.params", "scheduler",
          "scheduler.params", "activation_checkpointing", "data_types", "tensor_parallel"}


def lookup(key: str) -> Key | None:
    """The table's entry for a dotted key as the user wrote it (aliases and "block.*")."""
    key = ALIASES.get(key, key)
    if key in TABLE:
        return TABLE[key]
    parent = key.rpartition(".")[0]
    return TABLE.get(f"{parent}.*") if parent else None


def _default(k: Key) -> str:
    if k.doc_default:
        return k.doc_default
    if k.default is ABSENT:
        return "-"
    v = k.default
    if isinstance(v, int) and not isinstance(v, bool) and v >= 10_000 and str(v).rstrip("0") in "123456789":
        return f"{str(v).rstrip('0')}e{len(str(v)) - 1}"  # 500000000 as DeepSpeed writes it: 5e8
    return "null" if v is None else "true" if v is True else "false" if v is False else \
        f'"{v}"' if isinstance(v, str) else f"{v:g}" if isinstance(v, float) else \
        f"[{', '.join(str(x) for x in v)}]" if isinstance(v, tuple) else str(v)


def markdown() -> str:
    """The docs' key table (docs/migrating-from-deepspeed.md, between its markers)."""
    aliases: dict[str, list[str]] = {}
    for a, k in ALIASES.items():
        aliases.setdefault(k, []).append(a)
    out = []
    for action, title, col in ((MAP, "Mapped", "zerompi"), (IGNORE, "Ignored (does not change the trained "
                               "model)", "why"), (REFUSE, "Refused when switched on", "why")):
        out += [f"### {title}", "", f"| DeepSpeed key | DeepSpeed's default | {col} |", "|---|---|---|"]
        for k in _TABLE:
            if k.action == action:
                also = f" (also `{'`, `'.join(sorted(aliases[k.key]))}`)" if k.key in aliases else ""
                what = k.what + (" (not named: zerompi does it anyway)" if k.quiet else "")
                out.append(f"| `{k.key}`{also} | {_default(k)} | {what.replace('|', '/')} |")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
