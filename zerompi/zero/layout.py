"""The stage table and the one builder of a run's layout, used by the engine and by the
estimator's dry run alike (so the dry run is the engine's layout, not a copy of it):
bucket -> parameter plan (order, stage-3 units) -> FlatLayout over N ranks -> the chunks
a rank owns -> its ShardState. Pure: no communication, no parameter memory (the dry run
passes a meta placement)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..device import Placement
from ..precision import DTYPES
from . import buckets, grads
from .params import Plan, ReplicatedParams
from .partition import Chunk, FlatLayout
from .stage3 import PartitionedParams
from .state import ShardState
from .stage3.units import coalesce_target


@dataclass(frozen=True)
class Parts:
    store: type          # where working parameters live between uses
    reduction: str       # how gradients reach the optimizer (grads.MODES)
    owns_all: bool       # every rank holds and updates everything (plain data parallel)
    full_grads: bool     # a full flat gradient buffer accumulates across micro-steps


# The one place a stage number means something.
PARTS = {
    0: Parts(ReplicatedParams, grads.ALL_REDUCE, owns_all=True, full_grads=True),
    1: Parts(ReplicatedParams, grads.SCATTER_AT_BOUNDARY, owns_all=False, full_grads=True),
    2: Parts(ReplicatedParams, grads.SCATTER_PER_BUCKET, owns_all=False, full_grads=False),
    3: Parts(PartitionedParams, grads.SCATTER_PER_BUCKET, owns_all=False, full_grads=False),
}


def bucket(cfg, world: int, stage: int, precision: str | None = None, device: str = "cpu") -> tuple[int, bool]:
    """(bucket elements, at_least) of zero.bucket_size at `world` ranks on `device`'s
    type (buckets.py)."""
    return buckets.bucket_policy(cfg.bucket_size, world, elem_bytes=buckets.auto_elem_bytes(
        precision or cfg.precision, cfg.reduce_dtype, stage), device=device)


def plan(model, trainable: list, cfg, stage: int, bucket_size: int, at_least: bool) -> Plan:
    """The stage's parameter plan: flat order and (stage 3) units, coalesced for the bucket."""
    return PARTS[stage].store.plan(model, trainable, cfg,
                                   coalesce_below=coalesce_target(cfg.stage3, bucket_size, at_least))


def flat_layout(p: Plan, world: int, cfg, bucket_size: int, at_least: bool, replicas: int = 1) -> FlatLayout:
    """Over `world` ranks (a shard group's K), replicated over `replicas` groups."""
    return FlatLayout([q.numel() for _, q in p.order], world, bucket_size, cfg.alignment,
                      units=p.unit_sizes, at_least=at_least, replicas=replicas)


def owned(layout: FlatLayout, stage: int, rank: int) -> list[Chunk]:
    """The chunks `rank` holds and updates: every block at stage 0 (shard index = flat
    index), chunk `rank` of every block otherwise."""
    if PARTS[stage].owns_all:
        return [Chunk(k, s, e, s) for k, (s, e) in enumerate(layout.blocks)]
    return layout.chunks(rank)


def shard_state(layout: FlatLayout, own: list[Chunk], placement: Placement, stage: int, precision: str,
                grad_accum_dtype: str, offload: bool = False, staging: int = 0) -> ShardState:
    parts, dtype = PARTS[stage], DTYPES[precision]
    grad_dtype = torch.float32 if grad_accum_dtype == "fp32" else dtype
    return ShardState(layout, own, placement, dtype, grad_dtype, replicated=parts.store is ReplicatedParams,
                      full_grads=parts.full_grads, offload=offload, staging=staging)
