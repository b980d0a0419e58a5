"""ZeRO-R activation checkpointing at block boundaries (docs/activation-checkpointing.md).

    acts = activations.apply(model, cfg.activation_checkpointing, dims.tp, placement)

The engine calls this once (config `activation_checkpointing.enabled`). The blocks are
the repeated children of an nn.ModuleList / nn.Sequential - the same "auto" rule stage 3
uses for its units (zero/stage3/units.py) - and each block's `forward` is replaced on the
instance (the model's class is untouched; `acts.remove()` undoes it). A checkpointed
call runs the block under no_grad and keeps only its input; its backward restores the
input, recomputes the block with grad enabled (CPU and CUDA RNG states as at the
forward, so dropout repeats; the surrounding RNG stream is left as it was) and
back-propagates through the recomputation. Where the kept input waits (Pa slices over
tp, host offload, the contiguous arena): ckpt_store.py.

Arguments: the first tensor argument (positional, else keyword) is the checkpointed
input - partitioned/offloaded; every other top-level tensor argument is kept as is
(and gets its gradient); non-tensor arguments and tensors nested in containers are
passed through unchanged (no gradient flows into nested tensors). Outputs may be any
pytree of tensors and other values. Under no_grad (evaluation) blocks run plainly.

Stage 3: the block's unit is gathered by its output's gradient hook before this
backward runs, and stays gathered during the recomputation (zero/stage3/store.py).
"""
from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..models.blocks import repeated_blocks
from .ckpt_store import Saved, Store, log_rank0


def checkpoint_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of the blocks to checkpoint: the model's repeated blocks, the
    same rule as stage 3's "auto" units (models/blocks.py)."""
    modules = dict(model.named_modules(remove_duplicate=False))
    return [(n, modules[n]) for n in repeated_blocks(model)]


class _Call:
    """One checkpointed call: how to call the block again, and what it kept."""

    def __init__(self, acts: "ActivationCheckpointing", orig, args: tuple, kwargs: dict, slots: list):
        self.acts, self.orig, self.args, self.kwargs, self.slots = acts, orig, args, kwargs, slots
        self.spec = self.saved = None
        self.cpu_rng = torch.get_rng_state()
        self.cuda_dev = None

    def call(self, x: torch.Tensor, others) -> Any:
        args, kwargs = list(self.args), dict(self.kwargs)
        for (kind, key), t in zip(self.slots, (x, *others)):
            if kind == "a":
                args[key] = t
            else:
                kwargs[key] = t
        return self.orig(*args, **kwargs)


def _get(args, kwargs, slot):
    return args[slot[1]] if slot[0] == "a" else kwargs[slot[1]]


class _Checkpoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run: _Call, dummy, x, *others):
        ctx.run = run
        if x.is_cuda:
            run.cuda_dev = x.device
            run.cuda_rng = torch.cuda.get_rng_state(x.device)
        with torch.no_grad():
            out = run.call(x, others)
        flat, run.spec = tree_flatten(out)
        run.saved = run.acts.keep(x)
        ctx.save_for_backward(*others)
        ctx.mark_non_differentiable(*[t for t in flat if isinstance(t, torch.Tensor)
                                      and not (t.is_floating_point() or t.is_complex())])
        return tuple(flat)

    @staticmethod
    def backward(ctx, *grads):
        run = ctx.run
        acts, saved = run.acts, run.saved
        x = saved.finish_restore()
        prev = saved.prev() if saved.prev is not None else None
        if prev is not None:
            prev.start_restore()  # the next block to recompute: its transfer overlaps this one
        x = x.detach().requires_grad_(ctx.needs_input_grad[2])
        others = [o.detach().requires_grad_(need) for o, need in
                  zip(ctx.saved_tensors, ctx.needs_input_grad[3:])]
        devices = [run.cuda_dev] if run.cuda_dev is not None else []
        with torch.random.fork_rng(devices=devices), torch.enable_grad():
            torch.set_rng_state(run.cpu_rng)
            if run.cuda_dev is not None:
                torch.cuda.set_rng_state(run.cuda_rng, run.cuda_dev)
            out = run.call(x, others)
        flat, _ = tree_flatten(out)
        pairs = [(o, g) for o, g in zip(flat, grads) if isinstance(o, torch.Tensor)
                 and o.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        saved.release()
        acts.store.counters.recomputed += 1
        return (None, None, x.grad if ctx.needs_input_grad[2] else None,
                *[o.grad if need else None for o, need in zip(others, ctx.needs_input_grad[3:])])


class ActivationCheckpointing:
    """Checkpoints the blocks of one model (see the module docstring)."""

    def __init__(self, model: nn.Module, cfg, tp, placement):
        self.cfg, self.tp = cfg, tp
        self.blocks = checkpoint_blocks(model)
        if not self.blocks:
            log_rank0("activation_checkpointing.enabled: the model has no repeated blocks (children of a "
                      "ModuleList/Sequential of one class) - nothing is checkpointed")
        partition = cfg.partition and tp.size > 1
        if cfg.partition and tp.size == 1:
            log_rank0("activation_checkpointing.partition: tensor-parallel size 1, the kept inputs are "
                      "not split (no-op)")
        self.store = Store(tp, placement, partition, cfg.cpu_offload, cfg.contiguous,
                           slots=len(self.blocks), log=log_rank0)
        self._last = None  # weakref to the last Saved of this pass (prefetch order)
        self._dummy = torch.empty(0, requires_grad=True)  # outputs always reach backward
        self._wrapped: list[nn.Module] = []
        for _, blk in self.blocks:
            if "forward" in blk.__dict__:
                raise ValueError(f"activation checkpointing: block {type(blk).__name__} already has a "
                                 "forward set on the instance (applied twice?)")
            blk.forward = functools.partial(self._forward, blk.forward)
            self._wrapped.append(blk)

    # ------------------------------------------------------------------ the wrapper
    def _forward(self, orig, *args, **kwargs):
        if not torch.is_grad_enabled():
            return orig(*args, **kwargs)
        slots = ([("a", i) for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
                 + [("k", k) for k, v in kwargs.items() if isinstance(v, torch.Tensor)])
        if not slots:
            return orig(*args, **kwargs)  # nothing to keep: an ordinary call
        run = _Call(self, orig, args, kwargs, slots)
        flat = _Checkpoint.apply(run, self._dummy, *[_get(args, kwargs, s) for s in slots])
        return tree_unflatten(list(flat), run.spec)

    def keep(self, x: torch.Tensor) -> Saved:
        st = self.store
        if st.live == 0:  # a new forward pass: nothing of the last one is waiting
            self._last = None
            st.begin_pass()
        prev = self._last() if self._last is not None else None
        saved = Saved(st, x, prev)
        self._last = _weak(saved)
        return saved

    # ------------------------------------------------------------------ introspection
    def stats(self) -> dict:
        """Counters since construction: kept bytes now/peak per location, the arena
        reservations, Pa's all-gathers (elements as the Communicator counts them: the
        gathered output), checkpointed and recomputed calls."""
        c, st = self.store.counters, self.store
        return {"blocks": len(self.blocks), "tp_size": self.tp.size, "partitioned": st.partition,
                "kept_device": c.kept["device"], "kept_host": c.kept["host"],
                "peak_device": c.peak["device"], "peak_host": c.peak["host"],
                "arena_device": st.arenas["device"].reserved_bytes() if "device" in st.arenas else 0,
                "arena_host": st.arenas["host"].reserved_bytes() if "host" in st.arenas else 0,
                "arena_grown": sum(a.grown for a in st.arenas.values()),
                "gather_calls": c.gather_calls, "gather_elements": c.gather_elements,
                "gather_bytes": c.gather_bytes, "checkpoints": c.checkpoints, "recomputed": c.recomputed}

    def reset_gather_stats(self) -> None:
        c = self.store.counters
        c.gather_calls = c.gather_elements = c.gather_bytes = 0

    def memory_report(self) -> dict[str, int]:
        """Bytes set aside for kept checkpoints, device and host: the peak kept so far,
        or the arena's reservation when contiguous (held for the whole run), whichever
        is larger. Transient restore/recompute buffers are not included."""
        s = self.stats()
        return {"activation_ckpt_device": max(s["peak_device"], s["arena_device"]),
                "activation_ckpt_host": max(s["peak_host"], s["arena_host"])}

    def remove(self) -> None:
        """Undo: the blocks' own forward again."""
        for blk in self._wrapped:
            blk.__dict__.pop("forward", None)
        self._wrapped = []


def _weak(obj):
    import weakref

    return weakref.ref(obj)


def apply(model: nn.Module, cfg, tp, placement) -> ActivationCheckpointing:
    """Checkpoint `model`'s blocks per `cfg` (ActivationCheckpointingConfig) over the
    tensor-parallel Communicator `tp` (any size, 1 included), kept inputs on `placement`."""
    return ActivationCheckpointing(model, cfg, tp, placement)


def memory_report(acts: ActivationCheckpointing | None) -> dict[str, int]:
    """The engine's memory_report() entries (zeros when checkpointing is off)."""
    if acts is None:
        return {"activation_ckpt_device": 0, "activation_ckpt_host": 0}
    return acts.memory_report()
