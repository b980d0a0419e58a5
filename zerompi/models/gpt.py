"""GPT-2-style decoder-only transformer (pure torch, no distributed code).

Pre-norm blocks, learned position embeddings, output head tied to the token
embedding. Loss is always computed in fp32 so the model can be cast to
bf16/fp16 wholesale.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .gpt_config import PRESETS, GPTConfig, count_params

__all__ = ["GPTConfig", "PRESETS", "GPT", "count_params", "cross_entropy_fp32", "document_mask"]


def cross_entropy_fp32(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy computed in fp32: bf16/fp16 logits lose too much precision
    in a softmax over a large vocabulary."""
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))


def document_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """(B, 1, T, T) bool attention mask from (B, T) document ids: causal, and only
    within a document (every token sees itself, so no row is empty)."""
    t = doc_ids.shape[-1]
    causal = torch.ones(t, t, dtype=torch.bool, device=doc_ids.device).tril()
    return ((doc_ids[:, :, None] == doc_ids[:, None, :]) & causal)[:, None]


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.head_dim = cfg.n_embd // cfg.n_head
        self.dropout = cfg.dropout
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        # Widths come from the tensors, so a c_attn holding only some heads' q, k, v rows
        # (parallel/parallelize.py) works unchanged.
        b, t, _ = x.shape
        q, k, v = self.c_attn(x).chunk(3, dim=2)
        # (B, T, heads * hs) -> (B, heads, T, hs)
        q, k, v = (z.view(b, t, -1, self.head_dim).transpose(1, 2) for z in (q, k, v))
        # mask (B, 1, T, T) bool, True = may attend: causal within each document
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0, is_causal=mask is None
        )
        y = y.transpose(1, 2).contiguous().view(b, t, -1)
        return self.resid_drop(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.c_proj(F.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), mask)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT-2-style language model; ``lm_head.weight is wte.weight``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.h = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: one Parameter object
        # (logits, targets) -> scalar loss; replaceable (parallel/parallelize.py swaps in the
        # vocab-parallel cross-entropy). A plain function, not a module: no parameters.
        self.loss_fn = cross_entropy_fp32
        self._init_weights()

    @torch.no_grad()
    def _init_weights(self) -> None:
        # Fixed module order keeps init deterministic under torch.manual_seed.
        for m in self.modules():
            if isinstance(m, nn.Linear):
                if m is self.lm_head:
                    continue  # tied to wte, initialised there
                nn.init.normal_(m.weight, mean=0.0, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Embedding):
                nn.init.normal_(m.weight, mean=0.0, std=0.02)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
        # GPT-2: scale residual-branch outputs so the stream's variance does not
        # grow with depth (two residual additions per block).
        std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for blk in self.h:
            nn.init.normal_(blk.attn.c_proj.weight, mean=0.0, std=std)
            nn.init.normal_(blk.mlp.c_proj.weight, mean=0.0, std=std)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None, doc_ids: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """idx: (B, T) int64 with T <= block_size. Returns logits (B, T, V),
        or ``(logits, loss)`` with the fp32 mean cross-entropy when targets given.
        doc_ids: optional (B, T) integers, equal for tokens of one document; a token then
        attends only to earlier tokens of its own document (docs/data.md, "Document mask").
        Positions stay those of the window (as in Megatron's and llm.c's packing)."""
        _, t = idx.shape
        if t > self.config.block_size:
            raise ValueError(f"sequence length {t} > block_size {self.config.block_size}")
        mask = document_mask(doc_ids) if doc_ids is not None else None
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for blk in self.h:
            x = blk(x) if mask is None else blk(x, mask)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return logits, self.loss_fn(logits, targets)

    def num_params(self, non_embedding: bool = False) -> int:
        """Parameter count, tied weight counted once. ``non_embedding`` drops
        the position embedding (the token embedding doubles as the head)."""
        n = sum(p.numel() for p in self.parameters())  # parameters() dedups ties
        return n - self.wpe.weight.numel() if non_embedding else n

    def flops_per_token(self) -> int:
        """Training FLOPs per token (fwd+bwd): 6N + 12*L*C*T, N non-embedding
        params; the second term is attention score/value matmuls."""
        c = self.config
        return 6 * self.num_params(non_embedding=True) + 12 * c.n_layer * c.n_embd * c.block_size
