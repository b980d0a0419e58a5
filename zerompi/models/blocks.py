"""The repeated blocks of a model: children of a ModuleList/Sequential whose class occurs
more than once among its siblings that hold parameters (the transformer layers of GPT,
BERT, T5, Llama, Mixtral, nn.TransformerEncoder), outermost only, so an expert list
stays inside its layer. Stage 3 gathers them as units and ZeRO-R checkpoints them: one
rule, used by both."""
from __future__ import annotations

from collections import Counter

import torch.nn as nn


def is_within(name: str, root: str) -> bool:
    """True when module `name` is `root` or inside it ("" is the whole model)."""
    return root == "" or name == root or name.startswith(root + ".")


def repeated_blocks(model: nn.Module) -> list[str]:
    """Qualified names of the repeated blocks, in module order."""
    found: list[str] = []
    for name, mod in model.named_modules(remove_duplicate=False):
        if not isinstance(mod, (nn.ModuleList, nn.Sequential)):
            continue
        if any(is_within(name, r) for r in found):
            continue  # inside a block already chosen
        kids = [(f"{name}.{k}" if name else k, c) for k, c in mod.named_children()]
        counts = Counter(type(c) for _, c in kids if any(True for _ in c.parameters()))
        found += [n for n, c in kids if counts[type(c)] > 1]
    return found
