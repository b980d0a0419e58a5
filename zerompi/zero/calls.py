"""The engine's public face beyond the training step: collective calls made safe, and
the DeepSpeed-style accessors (device, is_gradient_accumulation_boundary, comm stats).

A collective method must be called by every rank of the engine, at the same point of
the loop. Called on some ranks only, the callers would wait in (or worse, match) a
collective the others never make. So:
  - the calls every rank makes anyway (forward, backward, step) only name themselves:
    a wait that expires inside says "all_reduce at step 3 during engine.backward";
  - the others (full_state_dict, gathered, load_full_state_dict, save_checkpoint,
    load_checkpoint, full_grads) first agree on a communicator of their own (never
    matched against a training collective): every rank sends (method, micro-step).
    A rank that never calls leaves the callers waiting in "engine.<method>()", which the
    watchdog (runtime/watchdog.py) ends at zero.comm.timeout_s naming the method and
    where each other rank is ("rank 1 is not in a collective"); ranks that call different
    methods, or the same one at different micro-steps, all raise one error naming them.
The agreement costs one small pickled allgather per call; these calls are rare.
"""
from __future__ import annotations

import functools

import torch

from ..runtime import watchdog


def mpi_of(comm):
    """The mpi4py communicator under a zerompi Communicator (MPI, staged, NCCL's host
    side, a hierarchy's flat group), or None."""
    for attr in ("flat", "mpi"):
        comm = getattr(comm, attr, comm)
    return getattr(comm, "comm", None)


def call_comm(dims):
    """The communicator the checks agree on: a duplicate of the engine's world (collective
    over it, at engine construction); None on one rank or where none is found."""
    raw = mpi_of(dims.world)
    if raw is None or raw.Get_size() == 1:
        return None
    from ..comm.mpi import MPICommunicator

    return MPICommunicator(raw)  # duplicates it


def collective(name: str, check: bool = True, generous: str | None = None):
    """Decorate an engine method that every rank must call: `check` agrees first (see
    the module docstring), else the waits inside are only named after it. `generous`:
    the agreement waits under the checkpoint I/O deadline the call's own waits have
    (watchdog.generous: ranks that answer are slow writers, silent ones are gone)."""
    def deco(fn):
        @functools.wraps(fn)
        def wrapper(self, *args, **kwargs):
            if check:
                if generous:
                    with watchdog.generous(generous):
                        agree_on_call(self, name)
                else:
                    agree_on_call(self, name)
                return fn(self, *args, **kwargs)
            with watchdog.within(f"engine.{name}"):
                return fn(self, *args, **kwargs)
        return wrapper
    return deco


def agree_on_call(engine, name: str) -> None:
    comm = engine._calls
    if comm is None:
        return
    me = (name, engine.micro_steps)
    with watchdog.waiting(f"engine.{name}() (collective: every rank must call it)"):
        got = comm.allgather_object(me)
    if len(set(got)) == 1:
        return
    by: dict = {}
    for r, v in enumerate(got):
        by.setdefault(v, []).append(r)
    said = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs[:16]))}"
                     f"{' ...' if len(rs) > 16 else ''} called engine.{m}() at micro-step {s}"
                     for (m, s), rs in by.items())
    raise RuntimeError(f"engine.{name}() is collective: every rank must call it at the same point of the "
                       f"loop, but {said}")


STATES_KEY = "zerompi.attached"  # in client_state: the attached objects' states, by name


def attach_state(engine, name: str, obj) -> None:
    """Save `obj.state_dict()` (JSON-serialisable) with every engine.save_checkpoint and
    restore it by `obj.load_state_dict` in engine.load_checkpoint (a data loader's position)."""
    engine.__dict__.setdefault("_attached", {})[name] = obj


def require_boundary(engine, name: str) -> None:
    """A checkpoint holds no accumulated gradients: one saved between the micro-steps of an
    update would resume as a different run, so it is refused (on every rank alike)."""
    k, g = engine.micro_steps % engine.gradient_accumulation_steps, engine.gradient_accumulation_steps
    if k:
        raise ValueError(f"engine.{name}() after micro-step {k} of {g} of an update: the accumulated "
                         "gradients are not saved, so a resume would not continue this run; save after "
                         "the engine.step() that applies the update")


def with_attached(engine, client_state: dict | None) -> dict | None:
    attached = engine.__dict__.get("_attached")
    if not attached:
        return client_state
    if client_state is not None and STATES_KEY in client_state:
        raise ValueError(f"client_state key {STATES_KEY!r} is zerompi's own")
    return {**(client_state or {}), STATES_KEY: {n: o.state_dict() for n, o in attached.items()}}


def restore_attached(engine, client_state: dict | None) -> dict | None:
    """The user's client_state back; the attached objects take their saved states."""
    if not isinstance(client_state, dict) or STATES_KEY not in client_state:
        return client_state
    client_state = dict(client_state)
    states = client_state.pop(STATES_KEY)
    for name, obj in engine.__dict__.get("_attached", {}).items():
        if name in states:
            obj.load_state_dict(states[name])
    return client_state


class EngineFace:
    """Mixed into ZeroEngine: accessors DeepSpeed users reach for."""

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    def is_boundary(self) -> bool:
        """True when the current micro-step ends with an optimizer update."""
        return (self.micro_steps + 1) % self.gradient_accumulation_steps == 0

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale

    @property
    def device(self) -> torch.device:
        """Where the model's parameters and the engine's state live (this rank's GPU or cpu)."""
        return self.state.placement.device

    def is_gradient_accumulation_boundary(self) -> bool:
        """True when the current micro-batch's engine.step() updates the parameters
        (DeepSpeed's name; call it between backward and step)."""
        return self.is_boundary()

    @property
    def local_rank(self) -> int:
        """This rank's index on its node (DeepSpeed's engine.local_rank)."""
        return self.dims.local_rank

    def get_lr(self) -> list[float]:
        """The learning rate of each parameter group, as DeepSpeed's engine.get_lr()."""
        return [g["lr"] for g in getattr(self.optimizer, "param_groups", self.param_groups)]

    def comm_stats(self) -> dict:
        """Elements, bytes and seconds per collective on the data-parallel group since the last reset."""
        return self.comm.stats()

    def reset_comm_stats(self) -> None:
        self.comm.reset_stats()
