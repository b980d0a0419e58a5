"""What the model returned -> the loss `engine.backward` differentiates.

`loss = engine(x, y); engine.backward(loss)` works whatever the model returns:
  - a tensor: the loss itself (one element);
  - an object with a `loss` attribute or key (a `transformers` ModelOutput, a dict):
    that, when it is not None;
  - a tuple or list: its first element that is a floating-point tensor of one element
    (the package's GPT returns (logits, loss); a `transformers` model called with
    return_dict=False returns (loss, logits, ...)). Logits of one element (batch 1,
    sequence 1, vocabulary 1) would be taken for the loss: return the loss alone there.
Anything else is refused naming what was found, so a model that returned no loss (no
labels given) fails at backward with a message rather than deep inside autograd.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def _describe(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return f"tensor{tuple(v.shape)}"
    return type(v).__name__


def find_loss(out: Any) -> torch.Tensor:
    """The loss in a model's output, by the rule of this module's docstring."""
    if isinstance(out, torch.Tensor):
        if out.numel() != 1:
            raise ValueError(f"engine.backward expects a scalar loss, got shape {tuple(out.shape)}")
        return out
    loss = out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        return find_loss(loss)
    if isinstance(out, (tuple, list)):
        for v in out:
            if isinstance(v, torch.Tensor) and v.is_floating_point() and v.numel() == 1:
                return v
        got = ", ".join(_describe(v) for v in out) or "nothing"
        raise ValueError(f"engine.backward: the model's output ({got}) holds no one-element floating-point "
                         "tensor to take as the loss (did the model get its labels/targets?)")
    if isinstance(out, Mapping) or hasattr(out, "loss"):
        raise ValueError(f"engine.backward: the model's output ({type(out).__name__}) has loss=None "
                         "(a transformers model computes the loss only when given labels=...)")
    raise TypeError(f"engine.backward expects a loss tensor, a tuple holding one, or an output with .loss; "
                    f"got {type(out).__name__}")
