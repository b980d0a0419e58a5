"""Tensor parallelism for the reference GPT and the Llama family, applied from outside
the model.

    torch.manual_seed(seed)              # same seed on every rank: same full weights
    model = GPT(cfg)
    parallelize(model, dims.tp)          # in place; returns the model

Megatron-LM layout: per block, c_attn is column parallel over heads (tp rank t holds
heads [t*nh/tp, (t+1)*nh/tp) of q, k and v: a 3-group split), attn.c_proj row parallel,
mlp.c_fc column parallel, mlp.c_proj row parallel; the token embedding is split by
vocabulary rows, the vocabulary padded to a multiple of 128 x tp (padding rows zero);
the head stays tied to it (the same local Parameter) and yields local-vocabulary
logits; the loss becomes the vocab-parallel fp32 cross-entropy. LayerNorms, wpe and the
row-parallel biases stay replicated. Every local weight is a slice of the full one, so
the start is the same model whatever tp (checked by tests/multirank/test_tp_model.py).

After parallelize, `model(idx)` returns this rank's logits over its slice of the padded
vocabulary, (B, T, padded_vocab / tp), as Megatron does; columns at or past
`config.vocab_size` (global index) are padding and not part of the model. At tp=1 the
logits are (B, T, vocab_size) and every layer computes exactly what the plain one does
(bitwise: loss, gradients, steps). The loss is the full model's loss, the same on every
tp rank. `num_params()` counts local parameters (padding rows included).
"""
from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F

from .tensor_parallel import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                        VocabParallelLMHead, padded_vocab_size,
                                        vocab_parallel_cross_entropy)
from ..config.errors import ConfigError
from ..models.gpt import GPT
from ..models.llama import Llama

__all__ = ["parallelize", "check_tp", "VocabParallelCrossEntropy"]


class VocabParallelCrossEntropy:
    """GPT.loss_fn of a parallelized model: (local logits, targets) -> mean fp32 loss.
    At tp=1 the plain loss (F.cross_entropy; the head's logits are already real-vocab
    only), so the loss is bitwise the plain model's."""

    def __init__(self, tp, vocab_size: int, vocab_start: int):
        self.tp, self.vocab_size, self.vocab_start = tp, vocab_size, vocab_start

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            v = self.vocab_size
            return F.cross_entropy(logits[..., :v].float().reshape(-1, v), targets.reshape(-1))
        return vocab_parallel_cross_entropy(logits, targets, self.tp, self.vocab_size, self.vocab_start)

    def __repr__(self) -> str:
        return f"VocabParallelCrossEntropy(vocab={self.vocab_size}, tp {self.tp.rank}/{self.tp.size})"


def check_tp(cfg, tp_size: int) -> None:
    """ConfigError, naming tensor_parallel_size and the model field, when `cfg` (a
    GPTConfig or LlamaConfig) cannot be split over `tp_size` ranks."""
    problem = cfg.tp_problem(tp_size)
    if problem:
        raise ConfigError("tensor_parallel_size", tp_size, problem)


def parallelize(model, tp):
    """Split `model` (a GPT or a Llama built with full weights, the same on every rank)
    over the tp group `tp` (a Communicator, or a ParallelDims whose .tp is used), in place."""
    tp = getattr(tp, "tp", tp)
    if not isinstance(model, (GPT, Llama)):
        raise TypeError(f"parallelize: expected a zerompi GPT or Llama, got {type(model).__name__}")
    if getattr(model, "tp_size", None) is not None:
        raise ValueError("parallelize: this model is already tensor parallel")
    cfg = model.config
    check_tp(cfg, tp.size)
    padded = padded_vocab_size(cfg.vocab_size, tp.size)
    if isinstance(model, Llama):
        return _llama(model, tp, padded)
    for blk in model.h:
        blk.attn.c_attn = ColumnParallelLinear.from_linear(blk.attn.c_attn, tp, groups=3)
        blk.attn.c_proj = RowParallelLinear.from_linear(blk.attn.c_proj, tp)
        blk.mlp.c_fc = ColumnParallelLinear.from_linear(blk.mlp.c_fc, tp)
        blk.mlp.c_proj = RowParallelLinear.from_linear(blk.mlp.c_proj, tp)
    wte = VocabParallelEmbedding.from_embedding(model.wte, tp, padded)
    model.wte = wte
    model.lm_head = VocabParallelLMHead(wte)
    assert model.lm_head.weight is model.wte.weight
    return _finish(model, tp, wte)


def _llama(model: Llama, tp, padded: int) -> Llama:
    for blk in model.layers:
        a, m = blk.self_attn, blk.mlp
        a.q_proj, a.k_proj, a.v_proj = (ColumnParallelLinear.from_linear(lin, tp)
                                        for lin in (a.q_proj, a.k_proj, a.v_proj))
        a.o_proj = RowParallelLinear.from_linear(a.o_proj, tp)
        m.gate_proj, m.up_proj = (ColumnParallelLinear.from_linear(lin, tp) for lin in (m.gate_proj, m.up_proj))
        m.down_proj = RowParallelLinear.from_linear(m.down_proj, tp)
    tied = model.lm_head.weight is model.embed_tokens.weight
    emb = VocabParallelEmbedding.from_embedding(model.embed_tokens, tp, padded)
    model.embed_tokens = emb
    head = emb
    if not tied:  # the head's own rows, split and padded like the embedding's
        w = model.lm_head.weight
        head = VocabParallelEmbedding.from_embedding(
            SimpleNamespace(weight=w, num_embeddings=w.shape[0], embedding_dim=w.shape[1]), tp, padded)
    model.lm_head = VocabParallelLMHead(head)
    assert (model.lm_head.weight is model.embed_tokens.weight) == tied
    return _finish(model, tp, emb)


def _finish(model, tp, emb: VocabParallelEmbedding):
    model.loss_fn = VocabParallelCrossEntropy(tp, model.config.vocab_size, emb.vocab_start)
    model.tp_size = tp.size
    model.padded_vocab_size = emb.padded_vocab
    return model
