"""Stage 3 under torch.compile: no graph traced without the engine's hooks may run.

A stage-3 unit's parameters are present only between its root's gather hook and its
release, and the hooks are graph breaks (weak_hooks.py), so a graph traced with the hooks
in place never spans a release. A graph traced before them (the compiled model run once
before `zerompi.initialize`, or a graph of another instance of the same classes: dynamo
keys its caches by code, and by default does not guard on module hooks) runs the whole
model as one graph and reads released parameters: torch then fails with "The tensor has a
non-zero number of elements, but its data is not allocated yet". So, when the hooks are
registered: compiled graphs are dropped (they retrace, with the hooks, at the next call),
and graphs traced from then on guard on module hooks, so a graph traced for a module
without hooks is never taken for one with them.
"""
from __future__ import annotations

import sys


def before_hooks() -> None:
    """Called by PartitionedParams just before it registers its hooks."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is None:
        return  # nothing compiled in this process (importing dynamo costs seconds)
    if hasattr(dynamo.config, "skip_nnmodule_hook_guards"):
        dynamo.config.skip_nnmodule_hook_guards = False
    dynamo.reset()
