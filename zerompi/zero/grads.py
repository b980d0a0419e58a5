"""Gradient reduction during backward through constant-size buckets.

Each partition block is one bucket. As backward produces a parameter's gradient (a
post-accumulate-grad hook), the parameter is marked ready; when every parameter of the
next block is ready, the block is copied into a free fp32 bucket, pre-divided by the
number of contributions, and reduced asynchronously while backward continues:
reduce-scatter (stages 1-2: each rank receives only its chunk) or all-reduce (stage 0).

Blocks are launched strictly in one agreed order, so every rank issues the same
collectives in the same order even when hooks fire in a different order or a parameter
is unused on some rank (its block is flushed with zeros when backward ends). The order
is block order in the first reducing backward; the order in which blocks actually
became complete there is then recorded, rank 0's version is adopted by all ranks, and
used from then on (so a module unused in every step no longer holds back the buckets
behind it). At most `bucket_count` buckets exist; when all are in flight the oldest is
completed first.

Alone (a data-parallel group of one rank, `local`): there is nothing to reduce and the
state's gradient buffer already has the flat layout (one rank owns every block whole), so
autograd accumulates straight into it (views as .grad where the dtypes agree) and no
bucket, copy or collective exists. The 1 / contributions factor the buckets would have
applied is left to the optimizer's coefficient (`unapplied`).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn as nn

from ..runtime.watchdog import waiting
from .partition import FlatLayout
from .state import ShardState
from .weak_hooks import weakly

# How gradients reach the optimizer (the engine picks one per stage, zero/engine.py):
ALL_REDUCE = "all_reduce"            # accumulate in flat_grad; all-reduce at the boundary
SCATTER_AT_BOUNDARY = "scatter_at_boundary"  # accumulate in flat_grad; reduce-scatter at the boundary
SCATTER_PER_BUCKET = "scatter_per_bucket"    # every micro-step: .grad -> bucket -> grad_shard
MODES = (ALL_REDUCE, SCATTER_AT_BOUNDARY, SCATTER_PER_BUCKET)


@dataclass
class _Slot:
    bucket: torch.Tensor   # block-sized send buffer, in the reduction dtype
    recv: torch.Tensor     # this rank's chunk of the result
    scratch: torch.Tensor  # receive space for the ordered reduce-scatter


class GradReducer:
    """Reduces gradients of `params` laid out by `layout` over `comm`, into `state`.

    all_reduce / scatter_at_boundary: gradients accumulate (across micro-steps) in the
    full `state.flat_grad`; the reduction runs only in the boundary micro-step and writes
    back into it (the whole block, or only the own chunk). scatter_per_bucket: reduction
    every micro-step, from the parameters' transient .grad into `state.grad_shard`,
    whose .grad are then freed.
    """

    def __init__(self, params: Sequence[nn.Parameter], layout: FlatLayout, comm, mode: str,
                 state: ShardState, bucket_count: int, reduce_dtype: torch.dtype,
                 poll: "Callable[[], None] | None" = None, local: bool = False):
        if mode not in MODES:
            raise ValueError(f"gradient reduction {mode!r}: one of {MODES}")
        self.params, self.layout, self.comm, self.mode = list(params), layout, comm, mode
        self.own = {c.block: c for c in state.own}
        flat_grad = self.flat_grad = state.flat_grad
        self.grad_shard = state.grad_shard
        if (flat_grad is None) != (mode == SCATTER_PER_BUCKET):
            raise ValueError(f"gradient reduction {mode!r} does not match the state's gradient buffers")
        if local and not layout.alone:
            raise ValueError("local gradients need a layout over one rank")
        self.local = local
        self.unapplied = 1.0  # local: the pre_scale the optimizer's coefficient must apply
        self.streaming = False  # local: handing completed blocks to block_done in this backward
        nb = len(layout.blocks)
        self.block_pieces = [list(layout.pieces(s, e)) for s, e in layout.blocks]
        self.block_params = [sorted({pc.index for pc in pcs}) for pcs in self.block_pieces]
        # blocks whose pieces leave gaps (alignment, padding): their bucket is zeroed first
        self.gapped = [sum(pc.size for pc in pcs) < e - s for pcs, (s, e) in zip(self.block_pieces, layout.blocks)]
        self.param_blocks = [layout.param_blocks(i) for i in range(len(self.params))]
        # where gradients accumulate in place: the full buffer, or (local) the shard,
        # which over one rank is laid out as the flat space
        acc = flat_grad if flat_grad is not None else (self.grad_shard if local else None)
        self.acc = acc
        self.grad_views = None
        if acc is not None:
            self.grad_views = [acc[o:o + n].view(p.shape)
                               for p, o, n in zip(self.params, layout.offsets, layout.numels)]
        B = max(e - s for s, e in layout.blocks)
        c = B // layout.world
        new = lambda n: state.placement.empty(n, reduce_dtype)  # noqa: E731
        # Constant-size communication buffers (ZeRO-R CB): independent of the model size.
        self.slots_free = [] if local else [_Slot(new(B), new(c), new(B if layout.world > 1 else 0))
                                            for _ in range(min(bucket_count, nb))]
        self.inflight: deque = deque()
        self.active = False
        self.used = [0.0] * len(self.params)  # got a gradient since the last step()
        self.pre_scale = 1.0
        self.remaining = [0] * nb
        self.order = list(range(nb))
        self.pos = nb                    # next position in self.order to launch
        self.recorded = False            # launch order learnt from a real backward yet?
        self.completed: list[int] = []   # blocks in the order they became complete
        self.blocks_left = [0] * len(self.params)
        self.poll = poll                 # called while waiting for a bucket (stage 3: serve)
        self.block_done: "Callable[[int], None] | None" = None  # block k's result written (offload)
        self.handles = [p.register_post_accumulate_grad_hook(weakly(self, "_accumulated", i))
                        for i, p in enumerate(self.params)]
        self.attach_grads()

    def buffer_bytes(self) -> int:
        slots = self.slots_free + [s for _, _, s in self.inflight]
        return sum(t.numel() * t.element_size() for s in slots for t in (s.bucket, s.recv, s.scratch))

    @property
    def attaches(self) -> bool:
        """Gradients accumulate in place across micro-steps (stages 0-1, or local)."""
        return self.grad_views is not None

    def attach_grads(self) -> None:
        """Param-dtype storage: autograd accumulates straight into the buffer (stage 0/1's
        flat_grad, or the local shard); otherwise each .grad is folded in by the hook."""
        if self.grad_views is not None and self.acc.dtype == self.params[0].dtype:
            for p, v in zip(self.params, self.grad_views):
                if p.grad is not v:  # autograd accumulated in place: still attached
                    p.grad = v
        elif self.grad_views is not None:
            for p in self.params:
                p.grad = None

    def loose_grad_bytes(self) -> int:
        """Bytes of .grad tensors autograd holds outside our buffers right now."""
        views = self.grad_views or [None] * len(self.params)
        return sum(p.grad.numel() * p.grad.element_size() for p, v in zip(self.params, views)
                   if p.grad is not None and p.grad is not v)

    # ---------------------------------------------------------------- backward
    @property
    def every_micro_step(self) -> bool:
        """Reduce in every backward (no full gradient survives a micro-step)?"""
        return self.mode == SCATTER_PER_BUCKET and not self.local

    def begin(self, reduce: bool, pre_scale: float) -> None:
        """Called before loss.backward(): reduce in this backward or only accumulate."""
        if self.local:  # nothing to reduce: the optimizer applies the factor
            # the boundary backward's blocks are final as they complete: handed on (offload)
            self.streaming = reduce and self.block_done is not None
            self.unapplied, reduce = pre_scale, False
        self.active, self.pre_scale = reduce, pre_scale
        self.remaining = [len(b) for b in self.block_params]
        self.blocks_left = [len(b) for b in self.param_blocks]
        self.completed = []
        self.pos = 0 if reduce else len(self.remaining)

    def _accumulated(self, i: int, p: torch.Tensor) -> None:
        """Parameter i's gradient is complete for this backward (its hook, weak_hooks.py)."""
        self.used[i] = 1.0
        if self.grad_views is not None:
            v = self.grad_views[i]
            if p.grad is not v and p.grad is not None:
                # user replaced .grad (zero_grad(set_to_none), or fp32 storage): fold in
                v.add_(p.grad)
                p.grad = v if v.dtype == p.dtype else None
        if self.streaming:
            for k in self.param_blocks[i]:
                self.remaining[k] -= 1
                if self.remaining[k] == 0:
                    self.block_done(k)
        if not self.active:
            return
        for k in self.param_blocks[i]:
            self.remaining[k] -= 1
            if self.remaining[k] == 0:
                self.completed.append(k)
        for h, _, _ in self.inflight:
            h.test()  # drive MPI progress of earlier buckets
        self._launch_ready(final=False)

    def flush(self) -> None:
        """Called after loss.backward(): launch the blocks not launched yet (a parameter
        unused on this rank leaves its block incomplete; it is reduced with zeros)."""
        if self.active:
            self._launch_ready(final=True)

    def end(self) -> None:
        """After flush() on every rank: wait for all reductions (local: every block is
        final now, in place)."""
        if self.streaming:  # blocks of parameters unused in this backward
            self.streaming = False
            for k, left in enumerate(self.remaining):
                if left > 0:
                    self.block_done(k)
        if self.active:
            self._launch_ready(final=True)
            while self.inflight:
                self._complete(self.inflight.popleft(), poll=False)
            if not self.recorded:
                done = set(self.completed)
                order = self.completed + [k for k in range(len(self.remaining)) if k not in done]
                self.order = self.comm.bcast_object(order, root=0)
                self.recorded = True
        self.active = False

    # ---------------------------------------------------------------- buckets
    def _launch_ready(self, final: bool) -> None:
        nb = len(self.remaining)
        while self.pos < nb and (final or self.remaining[self.order[self.pos]] <= 0):
            self._launch(self.order[self.pos])
            self.pos += 1

    def _launch(self, k: int) -> None:
        if not self.slots_free:
            self._complete(self.inflight.popleft())
        slot = self.slots_free.pop()
        s, e = self.layout.blocks[k]
        b = e - s
        buf = slot.bucket[:b]
        if self.mode == SCATTER_PER_BUCKET:
            # one pass: every piece cast-copied into the bucket by one foreach launch; the
            # 1 / contributions factor is applied to the (N times smaller) result instead
            dst, src, pieces = [], [], self.block_pieces[k]
            for pc in pieces:
                p = self.params[pc.index]
                if p.grad is not None:
                    dst.append(buf[pc.flat_lo - s:pc.flat_hi - s])
                    src.append(p.grad.reshape(-1)[pc.param_lo:pc.param_hi])
            if self.gapped[k] or len(src) < len(pieces):
                buf.zero_()
            if src:
                torch._foreach_copy_(dst, src)
            for pc in pieces:
                self.blocks_left[pc.index] -= 1
                if self.blocks_left[pc.index] == 0:
                    self.params[pc.index].grad = None  # the full gradient is dropped once reduced
        else:
            torch.mul(self.flat_grad[s:e], self.pre_scale, out=buf)
        c = self.layout.chunk_size(k)
        if self.mode == ALL_REDUCE:
            h = self.comm.all_reduce(buf, async_op=True, scratch=slot.scratch)
        else:
            h = self.comm.reduce_scatter(buf, slot.recv[:c], async_op=True, scratch=slot.scratch)
        self.inflight.append((h, k, slot))

    def _complete(self, entry, poll: bool = True) -> None:
        h, k, slot = entry
        if poll and self.poll is not None:
            # Stage 3: a peer may be waiting for this rank in a gather round before it
            # can launch this very block; keep serving rounds instead of blocking. Under
            # the watchdog's deadline like any wait: a stopped or lost peer ends the job.
            with waiting(getattr(h, "_op", "gradient reduction")):
                while not h.test():
                    self.poll()
        h.wait()
        s, e = self.layout.blocks[k]
        if self.mode == ALL_REDUCE:
            self.flat_grad[s:e].copy_(slot.bucket[:e - s])
        else:
            ch = self.own[k]
            res = slot.recv[:ch.size]
            if self.mode == SCATTER_AT_BOUNDARY:
                self.flat_grad[ch.flat_lo:ch.flat_hi].copy_(res)
            else:
                self.grad_shard[ch.shard_lo:ch.shard_lo + ch.size].add_(res, alpha=self.pre_scale)
        self.slots_free.append(slot)
        if self.block_done is not None:
            self.block_done(k)
