"""Llama-class decoder (pure torch, no distributed code): RoPE, RMSNorm, SwiGLU,
grouped-query attention, untied embeddings (tied when tie_word_embeddings).

Module names are those of transformers' LlamaForCausalLM without its "model." prefix
(embed_tokens, layers.N.self_attn.q_proj, ..., norm, lm_head), so Hugging Face weights
map one to one (models/hf_names.py). Every computation follows LlamaForCausalLM's order
(RMSNorm in fp32, cos/sin cast to the activations' dtype, rotate-half RoPE), so the
logits match transformers' to rounding (tests/unit/test_llama.py states the tolerance).
Loss is fp32 cross-entropy, like the GPT's.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .gpt import cross_entropy_fp32
from .llama_config import PRESETS, LlamaConfig, count_params

__all__ = ["Llama", "LlamaConfig", "PRESETS", "count_params", "rope_inv_freq", "document_mask"]


def rope_inv_freq(cfg: LlamaConfig) -> torch.Tensor:
    """RoPE's inverse frequencies (fp32), with Llama 3.1's long-context rescaling when
    cfg.rope_scaling says llama3 (transformers' _compute_llama3_parameters)."""
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    s = cfg.rope_scaling
    if s is None or s.get("rope_type", "default") == "default":
        return inv
    factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old = s["original_max_position_embeddings"]
    lo_wavelen, hi_wavelen = old / lo, old / hi
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > lo_wavelen, inv / factor, inv)
    smooth = (old / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < hi_wavelen) * ~(wavelen > lo_wavelen)
    return torch.where(medium, smoothed, scaled)


def document_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) document ids -> (B, 1, T, T) boolean attention mask: causal and within
    the same document (True = attend)."""
    t = doc_ids.shape[-1]
    causal = torch.ones(t, t, dtype=torch.bool, device=doc_ids.device).tril()
    return (causal & (doc_ids[:, :, None] == doc_ids[:, None, :])).unsqueeze(1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # in fp32 whatever the activations' dtype, as transformers does
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        c, q, kv, b = cfg.n_embd, cfg.n_head * cfg.head_dim, cfg.n_kv_head * cfg.head_dim, cfg.attention_bias
        self.q_proj = nn.Linear(c, q, bias=b)
        self.k_proj = nn.Linear(c, kv, bias=b)
        self.v_proj = nn.Linear(c, kv, bias=b)
        self.o_proj = nn.Linear(q, c, bias=b)

    def forward(self, x, cos, sin, mask):
        # Head counts come from the tensors, so projections holding only some heads
        # (parallel/parallelize.py: q heads and kv heads split alike) work unchanged.
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, -1, self.head_dim).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        rep = q.shape[1] // k.shape[1]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                           enable_gqa=rep > 1)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        c, f, b = cfg.n_embd, cfg.intermediate_size, cfg.mlp_bias
        self.gate_proj = nn.Linear(c, f, bias=b)
        self.up_proj = nn.Linear(c, f, bias=b)
        self.down_proj = nn.Linear(f, c, bias=b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.n_embd, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.n_embd, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, mask=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    """Llama-class language model; ``lm_head.weight is embed_tokens.weight`` only when
    config.tie_word_embeddings."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.n_embd)
        self.layers = nn.ModuleList(LlamaBlock(config) for _ in range(config.n_layer))
        self.norm = RMSNorm(config.n_embd, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # (logits, targets) -> scalar loss; parallel/parallelize.py swaps in the
        # vocab-parallel cross-entropy. A plain function: no parameters.
        self.loss_fn = cross_entropy_fp32
        # RoPE tables are recomputed per (length, device, dtype), not registered buffers:
        # nothing for ZeRO to partition or checkpoints to hold
        self._rope: dict = {}
        self._init_weights()

    @torch.no_grad()
    def _init_weights(self) -> None:
        # transformers' Llama init (N(0, 0.02), norms 1), in a fixed module order
        for m in self.modules():
            if isinstance(m, nn.Linear):
                if self.config.tie_word_embeddings and m is self.lm_head:
                    continue
                nn.init.normal_(m.weight, mean=0.0, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Embedding):
                nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def rope(self, t: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape (T, head_dim) for positions 0..T-1, in `dtype`."""
        key = (t, str(device), dtype)
        if key not in self._rope:
            inv = rope_inv_freq(self.config).to(device)
            freqs = torch.arange(t, device=device).float()[:, None] * inv[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            self._rope = {key: (emb.cos().to(dtype), emb.sin().to(dtype))}  # one length kept
        return self._rope[key]

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                doc_ids: torch.Tensor | None = None):
        """idx: (B, T) int64, T <= block_size. doc_ids: optional (B, T) document ids; a
        token attends only to earlier tokens of its own document. Returns logits
        (B, T, V), or ``(logits, loss)`` with the fp32 mean cross-entropy."""
        _, t = idx.shape
        if t > self.config.block_size:
            raise ValueError(f"sequence length {t} > block_size {self.config.block_size}")
        x = self.embed_tokens(idx)
        cos, sin = self.rope(t, x.device, x.dtype)
        mask = None if doc_ids is None else document_mask(doc_ids)
        for blk in self.layers:
            x = blk(x, cos, sin, mask)
        logits = self.lm_head(self.norm(x))
        if targets is None:
            return logits
        return logits, self.loss_fn(logits, targets)

    def num_params(self, non_embedding: bool = False) -> int:
        """Parameter count (tied weight once); non_embedding leaves out the token
        embedding and an untied head."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.embed_tokens.weight.numel()
            if self.lm_head.weight is not self.embed_tokens.weight:
                n -= self.lm_head.weight.numel()
        return n

    def flops_per_token(self) -> int:
        """Training FLOPs per token (fwd+bwd): 6N + 12*L*(heads*head_dim)*T, N the
        non-embedding parameters plus an untied head's (its matmul is work)."""
        c = self.config
        n = count_params(c, non_embedding=True) + (0 if c.tie_word_embeddings else c.vocab_size * c.n_embd)
        return 6 * n + 12 * c.n_layer * c.n_head * c.head_dim * c.block_size
