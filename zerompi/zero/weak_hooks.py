"""Hooks that do not keep their owner alive.

torch keeps the Python objects of parameters and activations alive from C++, where the
garbage collector cannot follow, so a cycle through a tensor's hooks (parameter -> hook
-> engine part -> model -> parameter) is never collected: dropping the engine would leak
the model, its shards, gradients and buffers (seen on the GPU: a 1B model's dropped
stage-2 and stage-3 engines still held 24 GB). Hooks on tensors therefore reach their owner through a weak
reference; the engine holds the owner, and once it is gone the hooks do nothing.
"""
from __future__ import annotations

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
    return hook
