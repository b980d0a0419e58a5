"""What ZeRO does differently when the model is tensor-parallel (dims.tp.size > 1).

ZeRO partitions each tp rank's *local* parameters over its data-parallel group, exactly
as without tp; the tp group only shows up where values must be whole:
  - gradients of parameters replicated over tp (LayerNorms, row-parallel biases, wpe)
    are averaged over the tp group at the boundary, so replicas cannot drift apart;
  - the global gradient norm (and with it the overflow flag and clipping) is one sum
    over dp x tp, with replicated parameters counted once (weight 1/tp on each replica);
  - full tensors (full_state_dict, checkpoints) are assembled from the tp ranks' local
    pieces through parallel/tp_layout.py.
At tp = 1 every function here is the identity.
"""
from __future__ import annotations

import torch

from ..parallel import tp_layout


class TPGrads:
    def __init__(self, params: list, segments: list, views: list, tp):
        self.tp = tp
        self.any_split = any(tp_layout.split_of(p) is not None for p in params)  # a tp model (any tp size)
        rep = [tp_layout.split_of(params[s.param]) is None for s in segments]
        self.weights = [1.0 / tp.size if r else 1.0 for r in rep]  # per segment, for the norm
        self.replicated = [views[k][1] for k, r in enumerate(rep) if r]

    def average_replicated(self) -> None:
        """Mean over the tp group of the replicated parameters' gradient pieces (one
        all-reduce of their concatenation; these are small: norms, biases)."""
        if self.tp.size == 1 or not self.replicated:
            return
        buf = torch.cat([g.float().reshape(-1) for g in self.replicated])
        self.tp.all_reduce(buf)  # sync: every tp rank holds the same replicated segments
        buf /= self.tp.size
        pos = 0
        for g in self.replicated:
            g.copy_(buf[pos:pos + g.numel()].view_as(g))
            pos += g.numel()


def assemble_full(tracked: dict[str, torch.Tensor], params: dict, tp, root_only: bool
                  ) -> dict[str, torch.Tensor]:
    """Full tensors from every tp rank's local full-precision tensors (`tracked`, keyed by
    name, present on every rank of the tp group). Collective over tp. Returns them on tp
    rank 0 (every tp rank unless root_only). Padding (a vocabulary padded to 128 x tp,
    also at tp = 1) is cut off."""
    if not any(tp_layout.split_of(p) is not None for p in params.values()):
        return tracked
    splits = tp.allgather_object({n: tp_layout.split_of(p) for n, p in params.items() if n in tracked})
    root = not root_only or tp.rank == 0
    out = {}
    for name, local in tracked.items():
        split = splits[tp.rank][name]
        if split is None:
            if root:
                out[name] = local
            continue
        flat = local.reshape(-1).float().contiguous()
        recv = torch.empty(tp.size * flat.numel(), dtype=torch.float32, device=flat.device)
        tp.all_gather(flat, recv)
        if not root:
            continue
        full = torch.empty(split.full_shape, dtype=torch.float32, device=flat.device).view(-1)
        for r in range(tp.size):
            part = recv[r * flat.numel():(r + 1) * flat.numel()]
            for flo, fhi, llo in tp_layout.full_ranges(tuple(local.shape), splits[r][name], 0, flat.numel()):
                full[flo:fhi] = part[llo:llo + fhi - flo]
        out[name] = full.view(split.full_shape)
    return out
