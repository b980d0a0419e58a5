"""ModelConfig: the `model` table of TrainConfig (trainer/config.py), the family and shape
of the model `python -m zerompi.train` builds (models/build.py). No torch."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..config.errors import fail
from ..models.gpt_config import PRESETS

FAMILIES = ("auto", "gpt", "llama")


@dataclass(frozen=True)
class ModelConfig:
    """Which model to train: a family (GPT-2-style or Llama-class), a preset of it or a
    Hugging Face config.json, optionally reshaped (docs/models.md)."""

    family: str = "auto"
    """auto | gpt | llama. auto: the family of `config` (its model_type: gpt2 -> gpt,
    llama -> llama), else gpt."""
    preset: str = "tiny"
    """gpt: tiny | small | gpt-20m | gpt-200m | gpt2 | gpt-1b; llama: tiny | small |
    llama3.2-1b | llama2-7b | llama3-8b | llama3.1-8b. Not used with `config`."""
    config: str = ""
    """A Hugging Face config.json (or the directory holding it) to take the shape from
    (LlamaForCausalLM or GPT2LMHeadModel); empty: the preset. With init_from and no
    config, init_from's config.json."""
    n_layer: int = 0
    """Transformer blocks; 0 keeps the preset's (or config's) value (same for n_head,
    n_kv_head, n_embd, vocab_size)."""
    n_head: int = 0
    n_kv_head: int = 0
    """llama only: key/value heads (grouped-query attention)."""
    n_embd: int = 0
    vocab_size: int = 0
    dropout: float = 0.0
    """gpt only: dropout probability (every preset uses 0)."""
    bias: bool = True
    """gpt only: Linear and LayerNorm biases (every preset has them)."""

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            fail("family", self.family, f"must be one of {', '.join(FAMILIES)}")
        if not self.config and self.preset not in self._presets():
            fail("preset", self.preset, f"must be one of {', '.join(self._presets())} (family {self.kind})")
        for k in ("n_layer", "n_head", "n_kv_head", "n_embd", "vocab_size"):
            if getattr(self, k) < 0:
                fail(k, getattr(self, k), "must be >= 0 (0 = the preset's)")
        if not 0.0 <= self.dropout < 1.0:
            fail("dropout", self.dropout, "must be in [0, 1)")
        if self.kind == "llama" and self.dropout:
            fail("dropout", self.dropout, "must be 0 for the llama family (it has no dropout)")
        if self.kind == "gpt" and self.n_kv_head:
            fail("n_kv_head", self.n_kv_head, "is for the llama family only (must be 0)")
        self.shape()  # the shape is consistent

    @property
    def kind(self) -> str:
        """The family, resolved: gpt or llama."""
        if self.family != "auto":
            return self.family
        return self._hf()[0] if self.config else "gpt"

    def _presets(self) -> dict:
        if self.kind == "llama":
            from ..models.llama_config import PRESETS as LLAMA
            return LLAMA
        return PRESETS

    def _hf(self):
        """(family, shape) of `config`, read once per ModelConfig."""
        cached = self.__dict__.get("_hf_cache")
        if cached is None:
            from ..models.hf_names import config_from_hf
            from ..models.llama_config import read_hf_config
            try:
                cached = config_from_hf(read_hf_config(self.config), self.config)
            except (OSError, ValueError) as e:
                fail("config", self.config, str(e))
            object.__setattr__(self, "_hf_cache", cached)
        return cached

    def shape(self):
        """The GPTConfig or LlamaConfig to build (models/build.py)."""
        if self.config:
            family, base = self._hf()
            if self.family != "auto" and self.family != family:
                fail("family", self.family, f"the config {self.config} is a {family} model")
        else:
            base = self._presets()[self.preset]
        keys = ("n_layer", "n_head", "n_embd", "vocab_size") + (("n_kv_head",) if self.kind == "llama" else ())
        changes = {k: getattr(self, k) for k in keys if getattr(self, k)}
        if self.kind == "gpt":
            changes.update(dropout=self.dropout, bias=self.bias)
        elif "n_head" in changes or "n_embd" in changes:
            changes.setdefault("head_dim", 0)  # recomputed from the new width
        try:
            return dataclasses.replace(base, **changes)
        except ValueError as e:  # n_embd not divisible by n_head, ...: name a key the user set
            key = next((k for k in ("n_kv_head", "n_head", "n_embd") if k in str(e) and getattr(self, k)),
                       "config" if self.config else "preset")
            fail(key, getattr(self, key), str(e))

    def gpt_config(self):
        """The shape of either family (the name is older than the llama family)."""
        return self.shape()
