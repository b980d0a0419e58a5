"""A model's architecture as a plain record, for either family, without torch: what the
trainer saves in each checkpoint (trainer/checkpoints.py compares it on resume) and what
`python -m zerompi.export --hf` rebuilds the config.json from; and build(), the model
of a shape (importing torch then)."""
from __future__ import annotations

from dataclasses import fields

from .gpt_config import GPTConfig, count_params as gpt_params
from .llama_config import LlamaConfig, count_params as llama_params

# Every key of every family: a record holds them all (None where a family has no such
# field), so a resume compares a GPT's record with a Llama's key by key.
ARCHITECTURE = ("family", "n_layer", "n_head", "n_embd", "vocab_size", "block_size", "bias",
                "n_kv_head", "head_dim", "intermediate_size", "rope_theta", "rope_scaling", "rms_norm_eps",
                "tie_word_embeddings", "attention_bias", "mlp_bias")


def family(shape) -> str:
    return "llama" if isinstance(shape, LlamaConfig) else "gpt"


def record(shape) -> dict:
    """{key: value} over ARCHITECTURE (dropout is training, not architecture: left out)."""
    have = {f.name: getattr(shape, f.name) for f in fields(shape)}
    return {k: (family(shape) if k == "family" else have.get(k)) for k in ARCHITECTURE}


def shape_of(rec: dict):
    """The GPTConfig or LlamaConfig a record describes (a record without "family" is a
    GPT's, from checkpoints older than the llama family)."""
    cls = LlamaConfig if rec.get("family") == "llama" else GPTConfig
    names = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in rec.items() if k in names and v is not None})


def num_params(shape, non_embedding: bool = False) -> int:
    if isinstance(shape, LlamaConfig):
        return llama_params(shape, non_embedding)
    return gpt_params(shape, non_embedding)


def flops_per_token(shape, seq_len: int) -> int:
    """Training FLOPs per token (fwd+bwd) at `seq_len`: 6 x the parameters whose matmuls
    run per token (an untied head's included) + 12 x layers x attention width x seq_len."""
    if isinstance(shape, LlamaConfig):
        n = llama_params(shape, True) + (0 if shape.tie_word_embeddings else shape.vocab_size * shape.n_embd)
        return 6 * n + 12 * shape.n_layer * shape.n_head * shape.head_dim * seq_len
    return 6 * gpt_params(shape, True) + 12 * shape.n_layer * shape.n_embd * seq_len


def build(shape):
    """The model of a shape (imports torch)."""
    if isinstance(shape, LlamaConfig):
        from .llama import Llama
        return Llama(shape)
    from .gpt import GPT
    return GPT(shape)
