"""The one seam between an engine and zerompi/checkpoint/: what a checkpoint may read and set.

zero/ imports checkpoint/ (engine.save_checkpoint calls it), so checkpoint/ never imports
zero/: it receives this view (engine.checkpoint_view()) and uses it by duck typing, only
through the names in NAMES (tests/unit/test_checkpoint_seam.py scans checkpoint/ for any
other). An engine-like object that offers these names can be checkpointed.

The view keeps the two things a checkpoint leaves with the engine: the asynchronous
saver (checkpoint/background/saver.py, one per engine, reused by every save) and the
state fence (the snapshot copy the engine's next update waits for: take_fence, called by
the engine before its master weights or moments change).

It holds the engine weakly (the engine holds the view, the saver holds the view weakly):
no reference cycle keeps an engine, its staging buffer or its writer process alive.
"""
from __future__ import annotations

import weakref

from .state_io import STATE_KINDS

NAMES = frozenset({
    # read: the layout of the state and where it lives
    "dims", "rank", "config", "dtype", "module", "params", "param_names", "state_kinds", "placement",
    # read: hyper-parameters, counters, the scheduler
    "param_groups", "global_steps", "lr_scheduler",
    # the state itself, by parameter name and element range (zero/state_io.py)
    "settle", "export_state", "exported_elements", "import_state", "load_checkpoint",
    # set: the slots a checkpoint keeps with the engine
    "saver", "set_fence",
    # duck typing: a view is its own view
    "checkpoint_view",
})


class CheckpointView:
    def __init__(self, engine):
        self._engine = weakref.ref(engine)
        self.saver = None    # the asynchronous saver, made at the first asynchronous save
        self._fence = None   # a snapshot still copying the state: the next update waits for it

    @property
    def _e(self):
        e = self._engine()
        if e is None:
            raise ReferenceError("the engine of this checkpoint view is gone")
        return e

    def checkpoint_view(self) -> "CheckpointView":
        return self

    # ------------------------------------------------------------------ read
    dims = property(lambda self: self._e.dims, doc="ParallelDims: world (every rank), dp, tp, tp_size, nodes")
    rank = property(lambda self: self._e.rank, doc="this rank in the data-parallel group (seeds)")
    config = property(lambda self: self._e.config, doc="the ZeroConfig (precision, stage, seed; recorded)")
    dtype = property(lambda self: self._e.dtype, doc="the working parameters' torch dtype")
    module = property(lambda self: self._e.module, doc="the model (names, frozen parameters, buffers)")
    params = property(lambda self: self._e.params, doc="the trained parameters, in state order")
    param_names = property(lambda self: self._e.param_names, doc="their names, in the same order")
    state_kinds = property(lambda self: STATE_KINDS, doc="the state datasets: param, exp_avg, exp_avg_sq")
    placement = property(lambda self: self._e.state.placement, doc="where host staging memory comes from")
    param_groups = property(lambda self: self._e.param_groups, doc="torch-style groups (hyper-parameters)")
    global_steps = property(lambda self: self._e.global_steps, doc="optimizer updates applied")
    lr_scheduler = property(lambda self: self._e.lr_scheduler, doc="a torch scheduler, or None")

    # ------------------------------------------------------------------ the state
    def settle(self) -> None:
        """Read a step the device decided but the host has not (its counts change)."""
        self._e.settle()

    def export_state(self, views: bool = False) -> dict:
        return self._e.export_state(views)

    def exported_elements(self) -> int:
        return self._e.exported_elements()

    def import_state(self, fetch, steps: dict, param_groups: list, scaler: dict, counters: dict) -> None:
        self._e.import_state(fetch, steps, param_groups, scaler, counters)

    def load_checkpoint(self, directory, tag: str | None = None) -> dict | None:
        """The engine's collective load (with its call checks and attached objects)."""
        return self._e.load_checkpoint(directory, tag=tag)

    # ------------------------------------------------------------------ set
    def set_fence(self, fence) -> None:
        """The engine calls `fence()` before its state next changes (an async snapshot's copy)."""
        self._fence = fence

    def take_fence(self):
        """The engine's side: the fence to wait for (or None), cleared."""
        fence, self._fence = self._fence, None
        return fence
