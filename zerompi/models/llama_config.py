"""The shape of a Llama-class model (LlamaConfig), its presets, its closed-form parameter
count and its Hugging Face config.json in both directions: no torch, so `python -m
zerompi.train` checks a config before it imports torch (models/llama.py builds the model).

Field names shared with GPTConfig (vocab_size, block_size, n_layer, n_head, n_embd) mean
the same, so the trainer reads either family's shape the same way."""
from __future__ import annotations

import json
from dataclasses import dataclass, field

__all__ = ["LlamaConfig", "PRESETS", "count_params", "from_hf", "to_hf", "read_hf_config"]


@dataclass(frozen=True)
class LlamaConfig:
    """Shape of a Llama-class decoder (RoPE, RMSNorm, SwiGLU, grouped-query attention)."""

    vocab_size: int
    block_size: int
    """Maximum context length (HF max_position_embeddings)."""
    n_layer: int
    n_head: int
    """Query heads."""
    n_embd: int
    """Residual stream width (HF hidden_size)."""
    intermediate_size: int
    """SwiGLU hidden width (gate_proj/up_proj rows)."""
    n_kv_head: int = 0
    """Key/value heads (grouped-query attention); 0 = n_head (multi-head attention)."""
    head_dim: int = 0
    """Width of one head; 0 = n_embd // n_head."""
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = field(default=None, hash=False)
    """None, or Llama 3.1's {"rope_type": "llama3", "factor", "low_freq_factor",
    "high_freq_factor", "original_max_position_embeddings"}."""
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False

    def __post_init__(self) -> None:
        for k in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "intermediate_size"):
            if getattr(self, k) < 1:
                raise ValueError(f"{k}={getattr(self, k)} must be >= 1")
        if not self.n_kv_head:
            object.__setattr__(self, "n_kv_head", self.n_head)
        if not self.head_dim:
            if self.n_embd % self.n_head:
                raise ValueError(f"n_embd={self.n_embd} not divisible by n_head={self.n_head}")
            object.__setattr__(self, "head_dim", self.n_embd // self.n_head)
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_head={self.n_head} not divisible by n_kv_head={self.n_kv_head}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even (RoPE rotates pairs)")
        kind = (self.rope_scaling or {}).get("rope_type", "default")
        if kind not in ("default", "llama3"):
            raise ValueError(f"rope_scaling rope_type {kind!r}: only default and llama3 are supported")

    def tp_problem(self, tp_size: int) -> str | None:
        """Why this shape cannot be split over `tp_size` tensor-parallel ranks
        (parallel/parallelize.py: heads, kv heads and the SwiGLU width are split), or None."""
        for name, n in (("n_head", self.n_head), ("n_kv_head", self.n_kv_head),
                        ("intermediate_size", self.intermediate_size)):
            if n % tp_size:
                return f"must divide the model's {name} ({n})"
        return None


def count_params(cfg: LlamaConfig, non_embedding: bool = False) -> int:
    """Closed-form parameter count of ``Llama(cfg)`` (a tied head counted once);
    non_embedding leaves out the token embedding and an untied head."""
    c, hd, f = cfg.n_embd, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.n_head * hd, cfg.n_kv_head * hd
    attn = c * (q + 2 * kv) + q * c + int(cfg.attention_bias) * (q + 2 * kv + c)
    mlp = 3 * c * f + int(cfg.mlp_bias) * (2 * f + c)
    block = attn + mlp + 2 * c
    emb = cfg.vocab_size * c * (1 if cfg.tie_word_embeddings else 2)
    body = cfg.n_layer * block + c
    return body if non_embedding else body + emb


_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}

# Parameter counts (count_params) are checked by tests.
PRESETS: dict[str, LlamaConfig] = {
    # 106,816 params: byte-level, GQA (2 kv heads), for fast CPU tests.
    "tiny": LlamaConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_kv_head=2, n_embd=64,
                        intermediate_size=128),
    # 3,033,344 params: byte-level.
    "small": LlamaConfig(vocab_size=256, block_size=256, n_layer=4, n_head=8, n_kv_head=4, n_embd=256,
                         intermediate_size=688),
    # 1,235,814,400 params: Llama 3.2 1B's shape (tied embeddings, llama3 RoPE scaling).
    "llama3.2-1b": LlamaConfig(vocab_size=128256, block_size=131072, n_layer=16, n_head=32, n_kv_head=8,
                               n_embd=2048, intermediate_size=8192, head_dim=64, rope_theta=500000.0,
                               rope_scaling=dict(_LLAMA3_ROPE, factor=32.0), tie_word_embeddings=True),
    # 6,738,415,616 params: Llama 2 7B's shape (multi-head attention).
    "llama2-7b": LlamaConfig(vocab_size=32000, block_size=4096, n_layer=32, n_head=32, n_embd=4096,
                             intermediate_size=11008),
    # 8,030,261,248 params: Llama 3 8B's shape.
    "llama3-8b": LlamaConfig(vocab_size=128256, block_size=8192, n_layer=32, n_head=32, n_kv_head=8,
                             n_embd=4096, intermediate_size=14336, rope_theta=500000.0),
    # 8,030,261,248 params: Llama 3.1 8B's shape (llama3 RoPE scaling, 128k context).
    "llama3.1-8b": LlamaConfig(vocab_size=128256, block_size=131072, n_layer=32, n_head=32, n_kv_head=8,
                               n_embd=4096, intermediate_size=14336, rope_theta=500000.0,
                               rope_scaling=dict(_LLAMA3_ROPE)),
}


def read_hf_config(path: str) -> dict:
    """A Hugging Face config.json (a file, or a directory holding one) as a dict; an
    OSError/ValueError naming the file otherwise."""
    import os

    p = os.path.join(path, "config.json") if os.path.isdir(path) else path
    try:
        with open(p) as f:
            d = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{p}: not JSON ({e})") from None
    if not isinstance(d, dict):
        raise ValueError(f"{p}: not a JSON object")
    return d


def from_hf(d: dict) -> LlamaConfig:
    """LlamaConfig from a LlamaForCausalLM config.json dict (transformers 4.x and 5.x
    spellings of RoPE: rope_theta/rope_scaling, or rope_parameters)."""
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act {act!r}: Llama's SwiGLU needs silu")
    if d.get("pretraining_tp", 1) not in (1, None):
        raise ValueError(f"pretraining_tp {d['pretraining_tp']}: only 1 is supported")
    rope = dict(d.get("rope_parameters") or {})
    theta = rope.pop("rope_theta", d.get("rope_theta", 10000.0))
    scaling = d.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    if scaling is not None:
        scaling = dict(scaling)
        scaling["rope_type"] = scaling.get("rope_type", scaling.pop("type", "default"))
        scaling.pop("rope_theta", None)
        if scaling["rope_type"] == "default":
            scaling = None
    return LlamaConfig(
        vocab_size=d["vocab_size"], block_size=d.get("max_position_embeddings", 2048),
        n_layer=d["num_hidden_layers"], n_head=d["num_attention_heads"], n_embd=d["hidden_size"],
        intermediate_size=d["intermediate_size"],
        n_kv_head=d.get("num_key_value_heads") or d["num_attention_heads"],
        head_dim=d.get("head_dim") or 0, rms_norm_eps=d.get("rms_norm_eps", 1e-6), rope_theta=float(theta),
        rope_scaling=scaling, tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        attention_bias=bool(d.get("attention_bias", False)), mlp_bias=bool(d.get("mlp_bias", False)))


def to_hf(cfg: LlamaConfig, extra: dict | None = None) -> dict:
    """The config.json of LlamaForCausalLM for this shape (both RoPE spellings, so
    transformers 4.x and 5.x read it alike)."""
    rope = {"rope_type": "default"} if cfg.rope_scaling is None else dict(cfg.rope_scaling)
    d = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": cfg.vocab_size,
         "max_position_embeddings": cfg.block_size, "num_hidden_layers": cfg.n_layer,
         "num_attention_heads": cfg.n_head, "num_key_value_heads": cfg.n_kv_head,
         "hidden_size": cfg.n_embd, "intermediate_size": cfg.intermediate_size, "head_dim": cfg.head_dim,
         "hidden_act": "silu", "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
         "rope_scaling": None if cfg.rope_scaling is None else dict(cfg.rope_scaling), "rope_parameters": dict(rope, rope_theta=cfg.rope_theta),
         "tie_word_embeddings": cfg.tie_word_embeddings, "attention_bias": cfg.attention_bias,
         "attention_dropout": 0.0, "mlp_bias": cfg.mlp_bias, "pretraining_tp": 1,
         "torch_dtype": "float32"}
    d.update(extra or {})
    return d
