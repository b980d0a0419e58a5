"""The offloaded optimizer's staged pipeline (offload_optimizer = cpu; docs/offload.md).

One boundary step, as data (GPU):
  backward   every owned block's reduced gradient leaves for pinned host staging in its
             own dtype as soon as the reducer has written it (offload_io.Transfers)
  norm       the overflow check and squared norm run on the device gradients (the table
             kernels), then the step's one small all-reduce; one host wait for both
  D2H wait   a host wait for the last gradient copies
  host pass  one fused pass (optim/host_pass.py): unscale x clip, AdamW, the
             parameter-dtype copy written into pinned output staging, on `threads` threads
  upload     each tile as soon as the pass has written it, overlapping the next tiles;
             the training stream waits for the last one, then the all-gather
On the CPU the same steps run with plain copies.

offload.delayed_update (ZeRO-Offload's DPU): the host pass of step t is started and left
running; the step returns, and step t+1's forward and backward run on the parameters the
device already has (from update t-1) while it goes on. At step t+1's boundary the pass of
step t is waited for, its output uploaded and all-gathered, and update t+1 starts from
gradients taken at the parameters of update t-1. In symbols, with U the AdamW update:
p_t = U(p_{t-1}, g(p_{t-2})) instead of U(p_{t-1}, g(p_{t-1})); the first step has no
predecessor (g(p_0)). The master and moments are exact AdamW state for that gradient
sequence. settle() ends the overlap where the engine's state is read or replaced.
"""
from __future__ import annotations

import os
import time
import weakref

import torch

from ..optim.host_pass import HostPassAdamW
from ..runtime import console
from .offload_io import DeviceNorm, Transfers, busy_seconds, upload_tiles


def staging_pairs(cfg, placement) -> int:
    """How many staging pairs the state needs: 0 (offload off, or the copy pipeline),
    1, or 2 with the delayed update (backward fills one while the pass reads the other)."""
    off = cfg.offload
    if cfg.offload_optimizer != "cpu":
        return 0
    staged = off.pipeline == "staged" or off.delayed_update or (
        off.pipeline == "auto" and placement.is_cuda and cfg.optimizer.implementation != "torch"
        and cfg.tensor_parallel_size == 1)
    if staged and cfg.tensor_parallel_size > 1:
        from ..config import fail

        fail("offload.pipeline", "staged", "needs tensor_parallel_size 1 (replicated gradients are "
             "averaged over tp after backward, once they have left the device)")
    return (2 if off.delayed_update else 1) if staged else 0


def host_threads(setting, dims, delayed: bool) -> int:
    """offload.threads: an integer, or auto: the cores this process may run on, divided by
    the ranks on its node unless the launcher bound it to fewer than the node has; one
    fewer with the delayed update (the training thread keeps a core)."""
    if setting != "auto":
        return int(setting)
    mine = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    per_node = getattr(getattr(dims, "nodes", None), "per_node", 1) or 1
    share = mine // per_node if mine >= (os.cpu_count() or mine) else mine
    return max(1, share - (1 if delayed else 0))


def host_optimizer(segments, state, groups, n, cfg, dims) -> HostPassAdamW:
    off = cfg.offload
    tiles = [lo for lo, _, _ in upload_tiles(state, tile_elems(cfg, state))] + [state.owned]
    bufs = {"master": state.master, "exp_avg": state.exp_avg, "exp_avg_sq": state.exp_avg_sq,
            "grad": [g for g, _ in state.staging], "out": [o for _, o in state.staging]}
    opt = HostPassAdamW(segments, state.views, groups, n, bufs=bufs, owned=state.owned, bounds=tiles,
                        threads=host_threads(off.threads, dims, off.delayed_update), kernel=off.host_pass)
    if opt.fallback_reason:
        console.say(f"offload: the compiled host pass is unavailable ({opt.fallback_reason}); "
                    "torch's fused AdamW and a cast instead")
    return opt


def tile_elems(cfg, state) -> int:
    return cfg.offload.tile_elements


def settle(engine, write: bool = False) -> None:
    """Before the engine's state is read or (write) replaced: Offload.settle, if any."""
    if engine.offload is not None:
        engine.offload.settle(write)


def attach(engine) -> "Offload | None":
    return Offload(engine) if engine.state.staging else None


class Offload:
    """Drives the staged pipeline for one engine (engine.offload); holds it weakly."""

    def __init__(self, engine):
        st, cfg = engine.state, engine.config
        self.eng = weakref.proxy(engine)
        self.opt: HostPassAdamW = engine.optimizer
        self.io = Transfers(st, tile_elems(cfg, st))
        assert self.io.bounds == self.opt.bounds
        self.staging = st.staging
        self.delayed = cfg.offload.delayed_update
        self.slot = 0          # staging pair the boundary backward fills
        self.pending = None    # delayed: [job or None once joined, its slot]
        self.norm = None
        if st.placement.is_cuda:
            try:
                self.norm = DeviceNorm(st, self.opt.segments)
            except ImportError:  # no CuPy: the optimizer's per-segment norms, on the device too
                pass
            except Exception as err:  # noqa: BLE001  (a CuPy that cannot use this GPU)
                console.say(f"offload: no device norm kernel ({type(err).__name__}: {err}); "
                            "the optimizer's per-segment norms instead")
        self.boundary = weakref.WeakMethod(engine.is_boundary)
        engine.reducer.block_done = self._block_done
        self._phases: dict = {}
        self._events: dict = {}
        self.pass_seconds = None  # the delayed pass's own time, once joined

    # ------------------------------------------------------------ backward
    def _block_done(self, k: int) -> None:
        """GradReducer: block k's reduction is written; in the boundary backward it is final."""
        boundary = self.boundary()
        if boundary is not None and boundary():
            self.io.grad_block(k, self.staging[self.slot][0])

    # ------------------------------------------------------------ the step
    def step(self) -> bool:
        """engine.step() at the accumulation boundary (its checks and counters done)."""
        e, t0 = self.eng, time.perf_counter()
        ph = {"threads": self.opt.threads, "kernel": self.opt.kernel, "delayed": self.delayed,
              "grad_bytes": self.io.grad_bytes, "param_bytes": self.io.param_bytes,
              "host_bytes": self.host_bytes()}
        sumsq, used = e._grad_stats(self._local_norm())
        ph["grad_stats"] = time.perf_counter() - t0
        e._decide(sumsq, used)  # the engine's coefficient and bookkeeping, read at once
        updates, coef = e._read_now()
        ph["d2h_wait"] = self.io.grads_landed()
        if self.delayed:
            self._apply_pending(ph)
        if updates:
            e._fence_state()
            self._update(coef, used, ph)
        self.io.release_grads()
        e._zero_grads()
        ph["step"] = time.perf_counter() - t0
        self._phases = ph
        self._events = self.io.take_events()
        return updates

    def _local_norm(self) -> "torch.Tensor | None":
        """This rank's squared norm of the device gradients (the host staging may still be
        filling); None: the optimizer's own (ZeroEngine._grad_stats)."""
        if self.norm is not None:
            try:
                return self.norm(self.eng.tp_grads.weights)
            except Exception as err:  # noqa: BLE001  (e.g. NVRTC cannot build the kernel here)
                console.say(f"offload: the device norm kernel failed ({type(err).__name__}: {err}); "
                            "the optimizer's per-segment norms instead")
                self.norm = None
        return None

    def _update(self, coef: float, used, ph: dict) -> None:
        slot = self.slot
        t0 = time.perf_counter()
        self.io.slot_free(slot)  # the uploads of two steps ago have read this output slot
        job = self.opt.launch(coef, used, slot=slot, background=self.delayed)
        if self.delayed:
            self.pending = [job, slot]
            self.slot = (slot + 1) % len(self.staging)
            ph["launch"] = time.perf_counter() - t0
            return
        out = self.staging[slot][1]
        for t in range(self.opt.ntiles):
            job.wait(t)
            self.io.upload(t, out)
        job.join()
        ph["host_update"] = time.perf_counter() - t0
        ph["host_pass"] = job.seconds
        self.io.uploads_queued(slot)
        self.eng.param_store.after_update()  # sync: all-gather of the updated chunks
        ph["after_update"] = time.perf_counter() - t0 - ph["host_update"]

    def _apply_pending(self, ph: dict) -> None:
        """Delayed: wait for the previous step's pass, upload its output, all-gather."""
        if self.pending is None:
            return
        job, slot = self.pending
        self.pending = None
        t0 = time.perf_counter()
        if job is not None:
            job.join()
        ph["host_update_wait"] = time.perf_counter() - t0  # what the pass still needed
        ph["host_pass"] = self.pass_seconds = job.seconds if job is not None else self.pass_seconds
        out = self.staging[slot][1]
        for t in range(self.opt.ntiles):
            self.io.upload(t, out)
        self.io.uploads_queued(slot)
        self.eng.param_store.after_update()  # sync: all-gather of the updated chunks
        ph["apply"] = time.perf_counter() - t0

    # ------------------------------------------------------------ the engine's other users
    def settle(self, write: bool = False) -> None:
        """Before the engine's state is read (the pending pass finished: the master and
        moments are current; the device keeps its parameters, so reading changes nothing)
        or replaced (write: the pending update also goes to the device first, so nothing
        stale is uploaded over what is loaded or edited)."""
        if self.pending is None:
            return
        if self.pending[0] is not None:
            self.pending[0].join()
            self.pass_seconds = self.pending[0].seconds
            self.pending[0] = None
        if write:
            self._apply_pending({})

    def flush(self) -> None:
        """Put a pending delayed update on the device now (e.g. at the end of training)."""
        self.settle(write=True)

    def host_bytes(self) -> int:
        """Bytes one host pass reads and writes: gradient (read), master and moments (read
        and written), output (written)."""
        g, o = self.staging[0][0].element_size(), self.staging[0][1].element_size()
        return self.opt.owned * (g + 24 + o)

    def phases(self) -> dict:
        """The last optimizer step's seconds by phase (host clock; the copy engines' busy
        time from CUDA events: d2h_busy, upload_busy, None while those copies still run),
        threads, kernel and bytes. Never waits for the device."""
        ph = dict(self._phases)
        if self.io.cuda and ph:
            busy = busy_seconds(self._events)
            ph["d2h_busy"], ph["upload_busy"] = busy["d2h"], busy["upload"]
        return ph
