"""Hooks that do not keep their owner alive.

torch keeps the Python objects of parameters and activations alive from C++, where the
garbage collector cannot follow, so a cycle through a tensor's hooks (parameter -> hook
-> engine part -> model -> parameter) is never collected: dropping the engine would leak
the model, its shards, gradients and buffers (seen on the GPU: a 1B model's dropped
stage-2 and stage-3 engines still held 24 GB). Hooks on tensors therefore reach their owner through a weak
reference; the engine holds the owner, and once it is gone the hooks do nothing.

The hooks also stay out of torch.compile's graphs: they communicate (stage-3 gathers,
agreement rounds, gradient buckets) and read the engine's Python state, which a traced
copy would specialise on. Marked disabled, each is a graph break and runs eagerly, so
per-block and whole-model compile see the same hooks eager mode does (docs/quickstart.md,
"torch.compile"). Only when torch._dynamo is imported already, as any torch.compile
before `initialize` does: importing it would cost every run seconds.
"""
from __future__ import annotations

import sys
import weakref


def weakly(owner, method: str, *args):
    """A hook calling owner.method(*args, *its own arguments) while owner lives. Always
    returns None (a value returned by a forward or gradient hook would replace the
    output or the gradient)."""
    ref, fn = weakref.ref(owner), getattr(type(owner), method)  # looked up once, not per call

    def hook(*a) -> None:
        live = ref()
        if live is not None:
            fn(live, *args, *a)
    dynamo = sys.modules.get("torch._dynamo")
    return dynamo.disable(hook) if dynamo else hook
