"""Python's cyclic garbage collector and what a rank builds at start-up.

After `import torch` (and zerompi) a process holds a large heap of objects the collector
tracks, every one alive until the process ends. Left in the collector's view they are
walked by each full collection during the run (at moments that differ from rank to rank:
a synchronous step waits for the slowest) and by the passes of interpreter exit.
Megatron-LM's manual GC option answers the same jitter by collecting on all ranks
together; freezing the start-up heap removes most of the work instead, and leaves the
collector on for what the run itself creates.

The imports themselves trigger collections too (hundreds during `import torch`). A
command pauses the collector before its heavy imports and `freeze_startup_heap` turns
it back on. What each saves: docs/performance.md, "A rank's start-up and exit"."""
from __future__ import annotations

import gc

_paused = False  # pause_collector turned it off (and not the user)


def pause_collector() -> None:
    """No collections until `freeze_startup_heap()`: call it in a command right before its
    heavy imports (torch: objects that live until exit). A collector the user turned off
    stays off."""
    global _paused
    if gc.isenabled():
        gc.disable()
        _paused = True


def freeze_startup_heap() -> None:
    """Take every object alive now out of the cyclic collector's view, for good
    (gc.freeze), and turn the collector back on if `pause_collector` paused it. Call it
    once a job's imports are done, before it builds its model: what exists then (modules,
    classes, torch's registries) lives until exit anyway. No collection first: a full pass
    is costly and the imports' cyclic garbage is small (a paused start-up freezes more
    objects at the same peak RSS)."""
    global _paused
    gc.freeze()
    if _paused:
        gc.enable()
        _paused = False
