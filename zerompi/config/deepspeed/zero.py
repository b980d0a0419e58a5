"""DeepSpeed's zero_optimization, activation_checkpointing and data_types keys onto
ZeroConfig: stage, optimizer offload, the reduction bucket (no more buffer memory than
DeepSpeed's), the reduce / accumulation dtypes and the stage-3 knobs."""
from __future__ import annotations

from .values import Values
from ..errors import ConfigError

_AC = (("partition_activations", "partition"), ("cpu_checkpointing", "cpu_offload"),
       ("contiguous_memory_optimization", "contiguous"))


def map_zero(v: Values, t, precision: str, dp, run) -> None:
    z = t.zero
    overlap = v.get("zero_optimization.overlap_comm", None)  # read here: reduce_bucket_size's memory needs it
    if v.given("zero_optimization.stage"):
        z["stage"] = v.number("zero_optimization.stage", integer=True)
        if z["stage"] > 3:
            raise ConfigError(v.name("zero_optimization.stage"), z["stage"], "must be 0, 1, 2 or 3")
    stage = int(z.get("stage", run("zero.stage")))
    _offload(v, z)
    _stage3(v, z)
    _hierarchy(v, z, stage)
    _checkpointing(v, z)
    # DeepSpeed reduces and accumulates gradients in the parameters' dtype unless told otherwise.
    if not v.auto("communication_data_type"):
        z["reduce_dtype"] = v.dtype("communication_data_type", precision)
    if not v.auto("data_types.grad_accum_dtype"):
        z["grad_accum_dtype"] = v.dtype("data_types.grad_accum_dtype", precision)
    key = "data_types.param_dtype"
    if v.given(key) and v.dtype(key, precision) == "fp32" and precision != "fp32":
        raise ConfigError(v.name(key), v.get(key), f"zerompi keeps parameters in the bf16/fp16 block's dtype "
                          f"({precision}) and fp32 master weights in the optimizer")
    if v.given("data_types.buffer_dtype"):  # absent: buffers keep their dtype (DeepSpeed >= 0.19.2)
        z["buffer_dtype"] = "fp32" if v.dtype("data_types.buffer_dtype", precision) == "fp32" else "param"
    _bucket(v, t, stage, precision, z.get("reduce_dtype", run("zero.reduce_dtype")), overlap, dp, run)


def _offload(v: Values, z: dict) -> None:
    key = "zero_optimization.offload_optimizer.device"
    device = v.get(key) if v.given(key) else None
    if v.given("zero_optimization.cpu_offload"):  # DeepSpeed's older spelling of offload_optimizer cpu
        old = v.get("zero_optimization.cpu_offload")
        if not isinstance(old, bool):
            raise ConfigError(v.name("zero_optimization.cpu_offload"), old, "expected true or false")
        if old and device not in (None, "none"):
            raise ConfigError(v.name("zero_optimization.cpu_offload"), old, "given with offload_optimizer; "
                              "DeepSpeed refuses the old and the new spelling together too")
        device = "cpu" if old else device
    if device is None:
        return
    if device not in ("none", "cpu"):
        raise ConfigError(v.name(key), device, "zerompi offloads the optimizer to cpu only (nvme is refused: the "
                          "states would stay in memory)")
    z["offload_optimizer"] = device


def _stage3(v: Values, z: dict) -> None:
    s3 = {}
    for key, ours, low in (("stage3_param_persistence_threshold", "persistence_threshold", 0),
                           ("stage3_max_live_parameters", "max_live_parameters", 1)):
        if v.given(f"zero_optimization.{key}"):
            s3[ours] = v.number(f"zero_optimization.{key}", integer=True, low=low)
    if v.given("zero_optimization.stage3_prefetch_bucket_size"):
        # DeepSpeed prefetches by elements, zerompi by units ahead (bounded by
        # max_live_parameters): 0 means no prefetch in both; any other size -> 1 unit.
        n = v.number("zero_optimization.stage3_prefetch_bucket_size", integer=True)
        s3["prefetch_modules"] = 0 if n == 0 else 1
    if s3:
        z["stage3"] = s3


def _hierarchy(v: Values, z: dict, stage: int) -> None:
    """hpZ and MiCS: DeepSpeed's groups are consecutive ranks, as zerompi's (zero/groups.py)."""
    key = "zero_optimization.zero_hpz_partition_size"
    k = v.number(key, integer=True, low=1)
    if k > 1:
        z.setdefault("stage3", {})["secondary_partition"] = k
    key = "zero_optimization.mics_shard_size"
    k = v.get(key)
    if isinstance(k, bool) or not isinstance(k, int) or (k < 1 and k != -1):
        raise ConfigError(v.name(key), k, "expected -1 (off) or an integer >= 1")
    if k > 0 and stage != 3:
        raise ConfigError(v.name(key), k, "DeepSpeed applies MiCS at stage 3 only (stages 1-2 shard over all "
                          "ranks there); set stage 3, or zerompi's zero.shard_group for hybrid stages 1-2")
    if k > 0:
        z["shard_group"] = k


def _checkpointing(v: Values, z: dict) -> None:
    """partition_activations / cpu_checkpointing / contiguous_memory_optimization switch on
    zerompi's activation checkpointing (DeepSpeed checkpoints where the model calls
    deepspeed.checkpointing.checkpoint; zerompi checkpoints the model's repeated blocks)."""
    mapped = {}
    for key, ours in _AC:
        if v.given(f"activation_checkpointing.{key}"):
            mapped[ours] = v.get(f"activation_checkpointing.{key}")
            if not isinstance(mapped[ours], bool):
                raise ConfigError(v.name(f"activation_checkpointing.{key}"), mapped[ours], "expected true or false")
    if any(mapped.values()):
        z["activation_checkpointing"] = {"enabled": True, **mapped}


def buffer_bytes(bucket: int, n: int, bucket_count: int, reduce_bytes: int) -> int:
    """The most memory zerompi's gradient reducer holds for an integer bucket_size (every
    block at most the bucket): bucket_count slots of a send buffer, its 1/n chunk and
    (n > 1) the alltoall receive space (zero/grads.py; estimate/activations.py
    comm_buffer_bytes is the exact figure for a given layout)."""
    return bucket_count * (bucket + bucket // n + (bucket if n > 1 else 0)) * reduce_bytes


def _bucket(v: Values, t, stage: int, precision: str, reduce: str, overlap, dp, run) -> None:
    """reduce_bucket_size -> the largest bucket_size whose buffers fit in the memory
    DeepSpeed gives its reduction buffers of that many elements: (overlap_comm at stages
    1-2: two) buffers in the parameters' dtype (stage_1_and_2.py / stage3.py ipg buckets).
    Copied one-to-one it would cost several times that. The result does not depend on
    it (docs/scaling.md)."""
    key = "zero_optimization.reduce_bucket_size"
    if not v.given(key):
        return  # absent or "auto": the run's bucket_size
    r = v.number(key, integer=True)
    if r < 1:
        raise ConfigError(v.name(key), r, "must be >= 1 (elements per reduction bucket)")
    if stage == 0:
        t.ignored.append(f"{v.name(key)} (DeepSpeed does not use it without ZeRO)")
        return
    copies = 2 if stage in (1, 2) and (overlap is True) else 1
    param_bytes = 4 if precision == "fp32" else 2
    reduce_bytes = 4 if reduce == "fp32" or precision == "fp32" else 2
    n, count = dp()[0], int(run("zero.bucket_count"))
    budget = copies * r * param_bytes
    # buffer_bytes(b) <= count x reduce_bytes x b (2n + 1) / n (n > 1), 2b (n = 1): solve for b
    per = count * reduce_bytes * (2 * n + 1 if n > 1 else 2)
    unit = n * int(run("zero.alignment"))  # the layout rounds a bucket up to whole units: round down here
    bucket = max(unit, budget * (n if n > 1 else 1) // per // unit * unit)
    t.zero["bucket_size"] = bucket
    t.notes.append(f"{v.name(key)} {r:,} -> zero.bucket_size {bucket:,}: reduction buffers of at most "
                   f"{_size(budget)} per rank, as DeepSpeed's {copies} x {r:,} {precision} elements")


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"
