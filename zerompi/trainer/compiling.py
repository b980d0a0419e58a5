"""`compile = true`: torch.compile each repeated block of the model, in place.

Per-block compile, as torchtitan applies it: the blocks (models/blocks.py: the layers
stage 3 gathers as units and activation checkpointing wraps) are compiled one by one,
so stage 3's gathers and releases fall between compiled regions, and the blocks share
one compiled graph (same code, same shapes). In place (`Module.compile`), so parameter
names, checkpoints and exports are those of the uncompiled model. Applied before
`zerompi.initialize`, whose hooks are then graph breaks (zero/weak_hooks.py).
"""
from __future__ import annotations

import torch.nn as nn

from ..config.errors import ConfigError
from ..models.blocks import repeated_blocks


def compile_blocks(model: nn.Module, backend: str) -> list[str]:
    """Compile every repeated block of `model` with `backend`; their names."""
    names = repeated_blocks(model)
    if not names:
        raise ConfigError("compile", True, f"{type(model).__name__} has no repeated blocks to compile")
    import torch._dynamo

    known = torch._dynamo.list_backends(exclude_tags=())
    if backend not in known:
        raise ConfigError("compile_backend", backend, f"is not a torch.compile backend here "
                          f"({', '.join(b for b in known if 'TESTING' not in b)})")
    modules = dict(model.named_modules())
    for name in names:
        modules[name].compile(backend=backend)
    return names
