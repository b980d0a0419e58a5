"""Tensor-parallel layers (Megatron-LM style) over a tp Communicator.

    y = ColumnParallelLinear(...)(x)      # x replicated -> y split by output features
    z = RowParallelLinear(...)(y)         # y split by input features -> z replicated

copy_to_tp is the identity forward and all-reduces the gradient backward (where a
replicated activation enters a split computation); reduce_from_tp all-reduces forward
and is the identity backward (where partial results leave it). A replicated parameter
(LayerNorm, position embedding, row-parallel bias) therefore gets the same, full
gradient on every tp rank. Every split parameter is marked with its place in the full
tensor (tp_layout.mark); replicated ones are left unmarked.

At tp=1 no communication happens and every layer computes exactly what the plain torch
layer does (bitwise). Dropout inside tp regions is not handled (it would need a
tp-aware RNG): parallel/parallelize.py refuses dropout > 0 at tp > 1.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import tp_layout
from .tp_layout import TPSplit

__all__ = ["copy_to_tp", "reduce_from_tp", "ColumnParallelLinear", "RowParallelLinear",
           "VocabParallelEmbedding", "VocabParallelLMHead", "vocab_parallel_cross_entropy",
           "padded_vocab_size"]


def padded_vocab_size(vocab_size: int, tp_size: int, multiple: int = 128) -> int:
    """The vocabulary rounded up to a multiple of `multiple` x tp (Megatron's padding)."""
    m = multiple * tp_size
    return -(-vocab_size // m) * m


def _all_reduce(t: torch.Tensor, tp, op: str = "sum") -> torch.Tensor:
    """All-reduce of a copy of `t` (never `t` itself: autograd may have saved it).
    16-bit sums that the communicator cannot do natively travel in fp32."""
    out = t.contiguous().clone()
    flat = out.view(-1)
    if out.dtype in (torch.float16, torch.bfloat16) and (op != "sum" or flat.numel() % tp.size):
        wide = flat.float()
        tp.all_reduce(wide, op=op)
        flat.copy_(wide)
    else:
        tp.all_reduce(flat, op=op)
    return out


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return _all_reduce(g, ctx.tp), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        return _all_reduce(x, tp)

    @staticmethod
    def backward(ctx, g):
        return g, None


def copy_to_tp(x: torch.Tensor, tp) -> torch.Tensor:
    """Identity forward; the gradient is summed over the tp group backward."""
    return x if tp.size == 1 else _CopyToTP.apply(x, tp)


def reduce_from_tp(x: torch.Tensor, tp) -> torch.Tensor:
    """Sum over the tp group forward; identity backward."""
    return x if tp.size == 1 else _ReduceFromTP.apply(x, tp)


def _param(shape, device, dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, device=device, dtype=dtype))


@torch.no_grad()
def _init_(weight: torch.Tensor, bias: torch.Tensor | None, init: bool) -> None:
    """Standalone initialisation of a local shard (GPT-2's): N(0, 0.02), zero bias. Not
    tp-invariant; parallelize copies full weights in instead (init=False: no random
    numbers drawn, so the RNG stream is the same with and without tp)."""
    if init:
        nn.init.normal_(weight, 0.0, 0.02)
        if bias is not None:
            nn.init.zeros_(bias)


@torch.no_grad()
def _load_(p: torch.Tensor, value: torch.Tensor, like: torch.Tensor) -> None:
    p.copy_(value)
    p.requires_grad_(like.requires_grad)


class ColumnParallelLinear(nn.Module):
    """y_local = x W_local^T + b_local: this rank's rows of W (output features) and of b.

    With groups > 1 the full rows are `groups` equal blocks (a fused QKV: [q; k; v]) and
    this rank holds its share of each block, concatenated: tp rank t takes rows
    [g*G + t*G/tp, g*G + (t+1)*G/tp) of every block g, G = out_features / groups. The
    output stays split (a following RowParallelLinear consumes it)."""

    def __init__(self, in_features: int, out_features: int, tp, bias: bool = True,
                 groups: int = 1, device=None, dtype=None, init: bool = True):
        super().__init__()
        if out_features % (groups * tp.size):
            raise ValueError(f"out_features={out_features} not divisible by groups x tp ({groups} x {tp.size})")
        self.tp, self.in_features, self.out_features, self.groups = tp, in_features, out_features, groups
        local, start = out_features // tp.size, tp.rank * (out_features // groups // tp.size)
        self.weight = tp_layout.mark(_param((local, in_features), device, dtype),
                                     TPSplit(0, (out_features, in_features), start, groups))
        self.bias = (tp_layout.mark(_param((local,), device, dtype),
                                    TPSplit(0, (out_features,), start, groups)) if bias else None)
        _init_(self.weight, self.bias, init)

    def _rows(self, full: torch.Tensor) -> torch.Tensor:
        blocks = full.chunk(self.groups, dim=0)
        n, r = blocks[0].shape[0] // self.tp.size, self.tp.rank
        return torch.cat([b[r * n:(r + 1) * n] for b in blocks], dim=0)

    @classmethod
    def from_linear(cls, lin: nn.Linear, tp, groups: int = 1) -> "ColumnParallelLinear":
        """This rank's slice of a full nn.Linear (same values, device and dtype)."""
        w = lin.weight
        m = cls(lin.in_features, lin.out_features, tp, bias=lin.bias is not None,
                groups=groups, device=w.device, dtype=w.dtype, init=False)
        _load_(m.weight, m._rows(w), w)
        if m.bias is not None:
            _load_(m.bias, m._rows(lin.bias), lin.bias)
        return m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(copy_to_tp(x, self.tp), self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features} / tp {self.tp.size}, groups={self.groups}"


class RowParallelLinear(nn.Module):
    """y = sum over tp of x_local W_local^T, then + b: this rank's columns of W (input
    features); the input is already split (a ColumnParallelLinear's output); the bias is
    replicated (unmarked) and added once, after the reduction."""

    def __init__(self, in_features: int, out_features: int, tp, bias: bool = True,
                 device=None, dtype=None, init: bool = True):
        super().__init__()
        if in_features % tp.size:
            raise ValueError(f"in_features={in_features} not divisible by tp = {tp.size}")
        self.tp, self.in_features, self.out_features = tp, in_features, out_features
        local = in_features // tp.size
        self.weight = tp_layout.mark(_param((out_features, local), device, dtype),
                                     TPSplit(1, (out_features, in_features), tp.rank * local))
        self.bias = _param((out_features,), device, dtype) if bias else None
        _init_(self.weight, self.bias, init)

    @classmethod
    def from_linear(cls, lin: nn.Linear, tp) -> "RowParallelLinear":
        w = lin.weight
        m = cls(lin.in_features, lin.out_features, tp, bias=lin.bias is not None,
                device=w.device, dtype=w.dtype, init=False)
        n = m.weight.shape[1]
        _load_(m.weight, w[:, tp.rank * n:(tp.rank + 1) * n], w)
        if m.bias is not None:
            _load_(m.bias, lin.bias, lin.bias)
        return m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:  # nothing to reduce: exactly nn.Linear (fused bias)
            return F.linear(x, self.weight, self.bias)
        y = reduce_from_tp(F.linear(x, self.weight), self.tp)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"{self.in_features} / tp {self.tp.size} -> {self.out_features}"


class VocabParallelEmbedding(nn.Module):
    """Token embedding split by vocabulary rows. The vocabulary is padded to
    `padded_vocab` (a multiple of tp); rank t holds rows [t*Vl, (t+1)*Vl), Vl =
    padded_vocab / tp. Rows at or past `num_embeddings` are padding: zero, and never
    read (ids are < num_embeddings), never given a gradient. Ids outside this rank's
    range look up nothing here (output zeroed) and the partial outputs are summed."""

    def __init__(self, num_embeddings: int, embedding_dim: int, tp, padded_vocab: int | None = None,
                 device=None, dtype=None, init: bool = True):
        super().__init__()
        padded = padded_vocab_size(num_embeddings, tp.size) if padded_vocab is None else padded_vocab
        if padded % tp.size or padded < num_embeddings:
            raise ValueError(f"padded vocabulary {padded}: must be >= {num_embeddings} and "
                             f"divisible by tp = {tp.size}")
        self.tp, self.num_embeddings, self.embedding_dim = tp, num_embeddings, embedding_dim
        self.padded_vocab, self.local_vocab = padded, padded // tp.size
        self.vocab_start = tp.rank * self.local_vocab
        self.weight = tp_layout.mark(_param((self.local_vocab, embedding_dim), device, dtype),
                                     TPSplit(0, (num_embeddings, embedding_dim), self.vocab_start))
        _init_(self.weight, None, init)
        with torch.no_grad():
            self.weight[self.real_rows:].zero_()

    @property
    def real_rows(self) -> int:
        """How many of this rank's rows are real vocabulary (the rest are padding)."""
        return max(0, min(self.local_vocab, self.num_embeddings - self.vocab_start))

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, tp, padded_vocab: int | None = None):
        """This rank's rows of a full nn.Embedding (same values, device and dtype)."""
        w = emb.weight
        m = cls(emb.num_embeddings, emb.embedding_dim, tp, padded_vocab, w.device, w.dtype, init=False)
        local, n = torch.zeros_like(m.weight), m.real_rows  # padding rows stay zero
        local[:n] = w[m.vocab_start:m.vocab_start + n]
        _load_(m.weight, local, w)
        return m

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_start + self.local_vocab)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(out, self.tp)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings} (padded {self.padded_vocab}) / tp {self.tp.size}, {self.embedding_dim}"


class VocabParallelLMHead(nn.Module):
    """Output head tied to a VocabParallelEmbedding: `weight` is the embedding's own
    Parameter object. Returns this rank's local-vocabulary logits (..., Vl), padding
    columns included (zero weights: their logits are 0; the loss masks them). At tp=1:
    logits over the real vocabulary only, (..., vocab_size), exactly the plain head's."""

    def __init__(self, embedding: VocabParallelEmbedding):
        super().__init__()
        self.tp = embedding.tp
        self.weight = embedding.weight  # tied: one Parameter
        self.vocab_size, self.vocab_start = embedding.num_embeddings, embedding.vocab_start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:  # padding rows left out: the same matmul as the plain head
            return F.linear(x, self.weight[:self.vocab_size])
        return F.linear(copy_to_tp(x, self.tp), self.weight)


class _VocabParallelCE(torch.autograd.Function):
    """Per-token cross-entropy over (N, Vl) logits split by vocabulary; `real_cols` of
    this rank's columns are real, the rest padding."""

    @staticmethod
    def forward(ctx, logits, target, tp, vocab_start, real_cols):
        vl = logits.shape[1]
        x = logits
        if real_cols < vl:  # padding columns: -inf, so they take no probability
            x = logits.clone()
            x[:, real_cols:] = float("-inf")
        m = _all_reduce(x.max(dim=1).values, tp, op="max")
        e = torch.exp(x - m.unsqueeze(1))
        local = target - vocab_start
        own = (local >= 0) & (local < real_cols)
        idx = local.clamp(0, vl - 1)
        picked = x.gather(1, idx.unsqueeze(1)).squeeze(1) - m   # -inf where not own: masked
        picked = torch.where(own, picked, torch.zeros_like(picked))
        s, picked = _all_reduce(torch.stack([e.sum(dim=1), picked]), tp)  # one reduction for both
        e.div_(s.unsqueeze(1))  # softmax, kept for backward
        ctx.save_for_backward(e, idx, own)
        return torch.log(s) - picked

    @staticmethod
    def backward(ctx, g):
        softmax, idx, own = ctx.saved_tensors
        grad = softmax.clone()
        grad[torch.arange(grad.shape[0], device=grad.device), idx] -= own.to(grad.dtype)
        grad.mul_(g.unsqueeze(1))
        return grad, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, tp, vocab_size: int,
                                 vocab_start: int, ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy (fp32) of logits split by vocabulary over the tp group.

    logits: (..., Vl), this rank's columns [vocab_start, vocab_start + Vl) of the padded
    vocabulary; columns at or past `vocab_size` are padding and set to -inf before the
    softmax (fp64 logits stay fp64). targets: (...) int64 full-vocabulary ids;
    `ignore_index` tokens are left out of the mean. Same value on every tp rank."""
    vl = logits.shape[-1]
    x = (logits if logits.dtype == torch.float64 else logits.float()).reshape(-1, vl)
    t = targets.reshape(-1)
    real = max(0, min(vl, vocab_size - vocab_start))
    keep = t != ignore_index
    tok = _VocabParallelCE.apply(x, t.masked_fill(~keep, 0), tp, vocab_start, real)
    return (tok * keep).sum() / keep.sum()

