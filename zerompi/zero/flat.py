"""Contiguous flat buffers and the per-parameter views into them.

One allocation per kind of state (parameters, gradients, master, moments) keeps memory
unfragmented and lets the collectives run on large contiguous ranges (ZeRO-R "MD").
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn as nn

from .partition import Chunk, FlatLayout


def pack_into(flat: torch.Tensor, tensors: Sequence[torch.Tensor], layout: FlatLayout) -> torch.Tensor:
    """Copy `tensors` to their offsets in `flat` (a zeroed buffer of layout.total)."""
    for t, o, n in zip(tensors, layout.offsets, layout.numels):
        flat[o:o + n].copy_(t.detach().reshape(-1))
    return flat


def views(flat: torch.Tensor, layout: FlatLayout, shapes: Sequence[torch.Size]) -> list[torch.Tensor]:
    return [flat[o:o + n].view(shape) for o, n, shape in zip(layout.offsets, layout.numels, shapes)]


def bind_params(params: Sequence[nn.Parameter], flat: torch.Tensor, layout: FlatLayout) -> None:
    """Make every parameter's storage a view of `flat` (its dtype becomes flat's)."""
    for p, v in zip(params, views(flat, layout, [p.shape for p in params])):
        p.data = v


def gather_chunks(flat: torch.Tensor, layout: FlatLayout, chunks: Sequence[Chunk],
                  shard: torch.Tensor, blocks=None, base: int = 0) -> None:
    """shard[span.shard] = flat[span.mine] for every owned chunk (of `blocks`)."""
    for sp in layout.spans(chunks, blocks, base):
        shard[sp.shard].copy_(flat[sp.mine])


def unshard(shards: torch.Tensor, layout: FlatLayout) -> torch.Tensor:
    """Full flat buffer from all ranks' shards stacked as (world, shard_size)."""
    flat = torch.empty(layout.total, dtype=shards.dtype, device=shards.device)
    for k, (s, e) in enumerate(layout.blocks):
        c = layout.chunk_size(k)
        lo = layout.block_shard_lo[k]
        flat[s:e].view(layout.world, c).copy_(shards[:, lo:lo + c])
    return flat


def nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()
