"""The shape of a GPT (GPTConfig), its presets and closed-form parameter count: no torch,
so `python -m zerompi.train` checks a config before it imports torch (models/gpt.py builds
the model)."""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GPTConfig", "PRESETS", "count_params"]


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a GPT model."""

    vocab_size: int
    """Number of token ids (256 for byte-level data)."""
    block_size: int
    """Maximum context length; also the size of the position embedding."""
    n_layer: int
    """Number of transformer blocks."""
    n_head: int
    """Attention heads per block; must divide ``n_embd``."""
    n_embd: int
    """Residual stream width."""
    dropout: float = 0.0
    """Dropout probability (embeddings, attention, residual branches)."""
    bias: bool = True
    """Whether Linear and LayerNorm layers carry a bias."""

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} not divisible by n_head={self.n_head}")

    def tp_problem(self, tp_size: int) -> str | None:
        """Why this shape cannot be split over `tp_size` tensor-parallel ranks in the
        Megatron layout of parallel/parallelize.py, or None."""
        for field, n in (("n_head", self.n_head), ("4*n_embd", 4 * self.n_embd)):
            if n % tp_size:
                return f"must divide the model's {field} ({n})"
        if tp_size > 1 and self.dropout > 0:
            return (f"the model's dropout ({self.dropout}) must be 0 (dropout inside "
                    "tensor-parallel regions is not supported)")
        return None


def count_params(cfg: GPTConfig, non_embedding: bool = False) -> int:
    """Closed-form parameter count of ``GPT(cfg)`` (tied head counted once)."""
    c, b = cfg.n_embd, int(cfg.bias)
    ln = c * (1 + b)
    block = (
        2 * ln                      # ln_1, ln_2
        + 3 * c * c + b * 3 * c     # qkv
        + c * c + b * c             # attention output projection
        + 4 * c * c + b * 4 * c     # mlp up
        + 4 * c * c + b * c         # mlp down
    )
    n = cfg.vocab_size * c + cfg.block_size * c + cfg.n_layer * block + ln
    return n - cfg.block_size * c if non_embedding else n


# Parameter counts (count_params, tied head counted once) are checked by tests.
PRESETS: dict[str, GPTConfig] = {
    # 120,576 params: byte-level, for fast CPU tests.
    "tiny": GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=2, n_embd=64),
    # 3,257,856 params: byte-level.
    "small": GPTConfig(vocab_size=256, block_size=128, n_layer=4, n_head=4, n_embd=256),
    # 19,177,472 params: byte-level.
    "gpt-20m": GPTConfig(vocab_size=256, block_size=256, n_layer=6, n_head=8, n_embd=512),
    # 202,852,352 params: byte-level.
    "gpt-200m": GPTConfig(vocab_size=256, block_size=1024, n_layer=16, n_head=16, n_embd=1024),
    # 124,475,904 params: GPT-2 small shape, vocab padded 50257 -> 50304.
    "gpt2": GPTConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768),
    # 1,211,224,064 params: byte-level.
    "gpt-1b": GPTConfig(vocab_size=256, block_size=1024, n_layer=24, n_head=16, n_embd=2048),
}
