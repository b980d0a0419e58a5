"""Where a tensor-parallel parameter's local values sit in the full tensor.

The contract between the tensor-parallel layers (tensor_parallel.py), which mark the
parameters they split, and everything that must see full tensors (the engine's
full_state_dict, checkpoints, the gradient norm):

    split = split_of(p)        # None: p is replicated over the tp group
    split.dim, split.full_shape, split.start, split.groups

A split parameter holds, along `dim`, `groups` equal segments of local length
L = p.shape[dim] // groups; segment g covers full indices
[g * G + start, g * G + start + L) with G = full_shape[dim] // groups (a fused QKV weight
is 3 groups: q, k and v, each split by heads). Indices at or past the segment's end in
the full tensor (G) are padding (a vocabulary padded to a multiple of 128 x tp): they
are zero, never trained, and absent from checkpoints.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

_ATTR = "_zerompi_tp"


@dataclass(frozen=True)
class TPSplit:
    dim: int
    full_shape: tuple[int, ...]
    start: int
    groups: int = 1


def mark(p: torch.Tensor, split: TPSplit) -> torch.Tensor:
    setattr(p, _ATTR, split)
    return p


def split_of(p: torch.Tensor) -> TPSplit | None:
    return getattr(p, _ATTR, None)


def full_shape(p: torch.Tensor) -> tuple[int, ...]:
    s = split_of(p)
    return tuple(p.shape) if s is None else tuple(s.full_shape)


def full_ranges(p_shape: tuple[int, ...], split: TPSplit | None, lo: int, hi: int
                ) -> list[tuple[int, int, int]]:
    """The local row-major element range [lo, hi) of a parameter of shape `p_shape` as
    (full_lo, full_hi, local_lo) runs of the full tensor's row-major order, in local
    order; padding elements are left out. Replicated: one run, unchanged."""
    if split is None:
        return [(lo, hi, lo)] if hi > lo else []
    shape, d = tuple(int(x) for x in p_shape), split.dim
    L = shape[d] // split.groups
    G = split.full_shape[d] // split.groups
    inner = 1
    for x in shape[d + 1:]:
        inner *= x
    outer_local = shape[d] * inner         # elements per index of the dims before d
    outer_full = split.full_shape[d] * inner
    out: list[tuple[int, int, int]] = []
    pos = lo
    while pos < hi:
        o, rest = divmod(pos, outer_local)   # index over dims before d, offset within
        i, r = divmod(rest, inner)           # local index along d, offset after d
        g, li = divmod(i, L)
        fi = g * G + split.start + li        # full index along d
        if split.start + li >= G:            # padding: skip to the next segment or row
            nxt = pos - r + (L - li) * inner
            pos = min(hi, nxt)
            continue
        # contiguous in full order while d's index stays within this segment's real part
        run_end_local = pos - r + min(L - li, G - split.start - li) * inner
        end = min(hi, run_end_local)
        flo = o * outer_full + fi * inner + r
        if out and out[-1][1] == flo and out[-1][2] + (out[-1][1] - out[-1][0]) == pos:
            out[-1] = (out[-1][0], flo + end - pos, out[-1][2])
        else:
            out.append((flo, flo + end - pos, pos))
        pos = end
    return out


def local_index(p: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """This rank's local values cut from a full tensor (padding filled with zeros)."""
    split = split_of(p)
    if split is None:
        return full.reshape(p.shape)
    out = torch.zeros(p.shape, dtype=full.dtype)
    flat_out, flat_full = out.view(-1), full.reshape(-1)
    for flo, fhi, llo in full_ranges(tuple(p.shape), split, 0, p.numel()):
        flat_out[llo:llo + fhi - flo] = flat_full[flo:fhi]
    return out
