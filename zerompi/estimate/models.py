"""Which model the estimator sizes: a GPT shape (built on the `meta` device, so nothing
is allocated) or a bare parameter count.

A `ModelSpec` is what every other module of the estimator takes. A GPT spec gives the
real parameter list (shapes, module structure, the tied head), so the dry run lays it out
exactly as the engine would; a `--params` spec is one flat vector of Psi elements (no
module structure: stage 3 then has one unit, and activations are unknown).
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from ..models.gpt import GPT, PRESETS as GPT_PRESETS, GPTConfig, count_params

# Shapes used to check the estimator at scale, on top of zerompi.models.gpt.PRESETS.
# Exact parameter counts (count_params, tied head once) are in the comments and tested.
SHAPES: dict[str, GPTConfig] = {
    # 135,654,144: the byte-level reference GPT of benchmarks/compare_commits.py.
    "gpt-135m": GPTConfig(vocab_size=256, block_size=1024, n_layer=19, n_head=12, n_embd=768),
    # 7,464,116,224: the paper's 7.5B row (GPT-2 vocabulary padded to 50304).
    "gpt-7.5b": GPTConfig(vocab_size=50304, block_size=2048, n_layer=36, n_head=32, n_embd=4096),
    # 100,300,079,104: a 100B model (docs/scaling.md, "Hierarchy").
    "gpt-100b": GPTConfig(vocab_size=50304, block_size=2048, n_layer=124, n_head=64, n_embd=8192),
    # 129,294,942,208: the paper's 128B row.
    "gpt-128b": GPTConfig(vocab_size=50304, block_size=2048, n_layer=160, n_head=64, n_embd=8192),
    # 1,008,015,820,800: the paper's 1T row.
    "gpt-1t": GPTConfig(vocab_size=50304, block_size=2048, n_layer=128, n_head=160, n_embd=25600),
}
ALL_SHAPES: dict[str, GPTConfig] = {**GPT_PRESETS, **SHAPES}


@dataclass(frozen=True)
class ModelSpec:
    """A model to size: `gpt` (a GPT shape) or, when None, `psi` flat parameters."""

    name: str
    psi: int                         # trainable parameters (tied weights once), before tp
    gpt: GPTConfig | None = None
    seq_len: int = 0                 # tokens per sequence (0: the GPT's block size)

    @property
    def seq(self) -> int:
        return self.seq_len or (self.gpt.block_size if self.gpt else 0)

    def describe(self) -> str:
        if self.gpt is None:
            return f"{self.name}: {self.psi:,} parameters (a flat vector: no layer structure)"
        g = self.gpt
        return (f"{self.name}: GPT, {self.psi:,} parameters (vocab {g.vocab_size}, d {g.n_embd}, "
                f"{g.n_layer} layers, {g.n_head} heads, context {g.block_size}, sequence {self.seq})")


def from_shape(name: str, cfg: GPTConfig, seq_len: int = 0) -> ModelSpec:
    return ModelSpec(name, count_params(cfg), cfg, seq_len)


def from_preset(name: str) -> ModelSpec:
    if name not in ALL_SHAPES:
        raise ValueError(f"unknown model preset {name!r} (known: {', '.join(ALL_SHAPES)})")
    return from_shape(name, ALL_SHAPES[name])


def from_params(psi: float, seq_len: int = 0) -> ModelSpec:
    if not psi >= 1 or psi != psi:
        raise ValueError(f"--params must be >= 1, got {psi}")
    return ModelSpec(f"{_short(psi)} parameters", int(round(psi)), None, seq_len)


def from_train_config(tc) -> ModelSpec:
    """The model of a zerompi.trainer.config.TrainConfig (its preset/shape and block_size)."""
    cfg = tc.model.shape()
    if tc.model.kind != "gpt":
        raise ValueError(f"model.family {tc.model.kind}: the estimator knows the GPT family's shapes only "
                         "(use --params with the model's parameter count)")
    return ModelSpec(f"{tc.model.preset} (from config)", count_params(cfg), cfg, tc.seq_len)


def reshape(spec: ModelSpec, **changes) -> ModelSpec:
    """The same GPT with some fields changed (n_layer=..., n_embd=...)."""
    if spec.gpt is None:
        raise ValueError("a --params model has no shape to change")
    cfg = dataclasses.replace(spec.gpt, **changes)
    return ModelSpec(spec.name, count_params(cfg), cfg, spec.seq_len)


@contextlib.contextmanager
def on_meta():
    """torch.device("meta") for building a model, with torch.nn.init.normal_ a no-op on
    meta tensors: there is no value to set, and torch runs normal_ on meta through its
    Python decomposition, whose first call imports torch._dynamo (seconds of CPU; the
    measurement: docs/performance.md, "The test suite")."""
    normal_ = torch.nn.init.normal_

    def skip_on_meta(tensor, *args, **kwargs):
        return tensor if tensor.is_meta else normal_(tensor, *args, **kwargs)

    torch.nn.init.normal_ = skip_on_meta
    try:
        with torch.device("meta"):
            yield
    finally:
        torch.nn.init.normal_ = normal_


def meta_model(spec: ModelSpec, tp: int = 1) -> torch.nn.Module:
    """The real GPT module with every parameter on the `meta` device (no storage), split
    for one tp rank as parallel/parallelize.py splits it when tp > 1 (a tp size the model
    cannot take is the ConfigError the train command gives); for a bare count, a
    one-parameter stand-in of Psi / tp elements (no layers to split)."""
    with on_meta():
        if spec.gpt is not None:
            model = GPT(spec.gpt)
            if tp > 1:
                from ..parallel.parallelize import parallelize

                # parallelize reads only the group's size and rank while it splits; every
                # tp rank's share has the same shapes, so rank 0's stands for all
                parallelize(model, SimpleNamespace(size=tp, rank=0))
            return model
        m = torch.nn.Module()
        m.flat = torch.nn.Parameter(torch.empty(-(-spec.psi // tp)))
        return m


def _short(x: float) -> str:
    for div, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if x >= div:
            return f"{x / div:g}{unit}"
    return f"{x:g}"
