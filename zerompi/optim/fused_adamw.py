"""ShardedAdamW's update and gradient norm as one table-driven launch each per shard.

FusedShardAdamW keeps ShardedAdamW's interface and bookkeeping (segments, views, steps,
param_groups, state_dict) and replaces the per-segment torch ops by two kernels over
the segment table (zerompi/kernels/adamw_table.py): the fused AdamW, reading the stored
bf16/fp16/fp32 gradient, applying grad_coef (unscale x clip), updating master and
moments and writing the low-precision parameter in the same pass; and the fused
overflow + weighted squared norm, left on the device for the engine's one host sync.

Where the work runs is an executor: CupyExecutor launches on torch's current CUDA
stream over the ShardState's own memory (DLPack, no copies); NumpyExecutor runs the
numpy references over numpy views of a host ShardState, so the same offset selection,
skipping, step counting and scalar rows are tested without a GPU.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from ..kernels import adamw_table as kt
from ..kernels.adamw import adamw_scalars
from ..kernels.streams import cupy_stream
from .adamw import Segment, ShardedAdamW


def table_buffers(state, segments: Sequence[Segment]) -> tuple[dict, list[np.ndarray]]:
    """The base buffers and per-segment offsets that ShardState.views slices, as
    ({master, grad, exp_avg, exp_avg_sq, out}, [master, grad, moment, out offsets])."""
    shard = np.array([s.shard_lo for s in segments], np.int64)
    flat = np.array([s.flat_lo for s in segments], np.int64)
    # stages 0-2 keep a replicated flat_param indexed by flat offset; stage 3 its shard
    work, work_off = (state.flat_param, flat) if state.replicated else (state.shard_param, shard)
    # fp32 training: the parameters are the master and nothing low-precision is written
    master, master_off = (state.master, shard) if state.mixed else (work, work_off)
    grad, grad_off = ((state.grad_shard, shard) if state.grad_shard is not None
                      else (state.flat_grad, flat))
    out, out_off = (work, work_off) if state.mixed else (None, np.zeros_like(shard))
    bufs = {"master": master, "grad": grad, "exp_avg": state.exp_avg,
            "exp_avg_sq": state.exp_avg_sq, "out": out}
    return bufs, [master_off, grad_off, shard, out_off]


class FusedShardAdamW(ShardedAdamW):
    """ShardedAdamW over a ShardState's buffers as two launches per shard.

    grad_sq_norm returns a 0-d float64 tensor where the state lives (+inf on overflow)
    instead of a float, so that reading it is the step's one host sync."""

    def __init__(self, segments, state, param_groups: list[dict], num_params: int,
                 executor=None, tile: int = kt.TILE):
        super().__init__(segments, state.views, param_groups, num_params)
        bufs, offs = table_buffers(state, self.segments)
        self.table = kt.build_table([s.length for s in self.segments], *offs, tile=tile)
        kt.check_bounds(self.table, {k: (None if bufs[k] is None else bufs[k].numel())
                                     for k in kt.BUFFERS})
        self._seg_param = np.array([s.param for s in self.segments], np.int64)
        self._seg_group = np.array([s.group for s in self.segments], np.int64)
        if executor is None:
            executor = CupyExecutor() if state.placement.is_cuda else NumpyExecutor()
        self.executor = executor
        executor.bind(bufs, self.table)

    # the engine may pass the step's coefficient as a device tensor (zero/step_coef.py)
    takes_device_coef = True

    def step(self, grad_coef: float | None = None, used: Sequence[bool] | None = None,
             device_coef: torch.Tensor | None = None) -> None:
        """device_coef: float32 [grad_coef, skip] where the state lives; it replaces
        grad_coef, and skip != 0 leaves the state unchanged (the step counts still
        advance: the engine takes them back when it reads the skip)."""
        grad_coef = self._engine_call(grad_coef, device_coef)
        self._count_steps(used)
        self.executor.adamw(self.step_rows(grad_coef, used), device_coef)

    def step_rows(self, grad_coef: float, used: Sequence[bool] | None) -> np.ndarray:
        return scalar_rows(self._seg_param, self._seg_group, self.steps, self.groups, grad_coef, used)

    def grad_sq_norm(self, weights: Sequence[float] | None = None) -> torch.Tensor:
        """Weighted squared L2 norm of the stored gradients as a 0-d float64 tensor on
        the state's device, +inf if any gradient element is inf/nan; no host sync."""
        w = (np.ones(self.table.nseg) if weights is None
             else np.asarray(weights, np.float64).reshape(-1))
        if w.size != self.table.nseg:
            raise ValueError(f"{w.size} weights for {self.table.nseg} segments")
        return self.executor.grad_sq_norm(w)


def scalar_rows(seg_param: np.ndarray, seg_group: np.ndarray, steps: Sequence[int], param_groups: list[dict],
                grad_coef: float, used: Sequence[bool] | None) -> np.ndarray:
    """A step's fp32 scalar rows (nseg, 9), for step counts already advanced:
    adamw_scalars once per distinct (group, step), a zero row (skip) for a segment of an
    unused parameter. seg_param / seg_group: each segment's parameter and group."""
    rows = np.zeros((len(seg_param), kt.ROW_COLS), np.float32)
    active = np.ones(len(seg_param), bool) if used is None else np.asarray(used, bool)[seg_param]
    if not active.any():
        return rows
    pairs = np.stack([seg_group, np.asarray(steps, np.int64)[seg_param]], 1)[active]
    uniq, inv = np.unique(pairs, axis=0, return_inverse=True)
    made = []
    for g, st in uniq:
        hp = param_groups[int(g)]
        (beta1, beta2) = hp["betas"]
        made.append(kt.step_row(adamw_scalars(
            lr=hp["lr"], beta1=beta1, beta2=beta2, eps=hp["eps"],
            weight_decay=hp["weight_decay"], step=int(st), grad_coef=grad_coef)))
    rows[active] = np.stack(made)[inv.reshape(-1)]
    return rows


# ------------------------------------------------------------------ executors

def _host_array(t: torch.Tensor | None):
    if t is None:
        return None
    if t.device.type != "cpu":
        raise ValueError(f"NumpyExecutor needs host buffers, got one on {t.device}")
    if t.dtype == torch.bfloat16:  # numpy has no bf16: its bit patterns as uint16
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


class NumpyExecutor:
    """The numpy references over numpy views (shared memory) of host buffers.
    fma/sqrt as adamw_reference: defaults are the kernels' arithmetic."""

    def __init__(self, *, fma: bool = True, sqrt=np.sqrt):
        self.fma, self.sqrt = fma, sqrt

    def bind(self, bufs: dict, table: kt.Table) -> None:
        self.a = {k: _host_array(v) for k, v in bufs.items()}
        self.table = table

    def adamw(self, rows: np.ndarray, coef: torch.Tensor | None = None) -> None:
        a = self.a
        kt.adamw_table_reference(a["master"], a["exp_avg"], a["exp_avg_sq"], a["grad"], a["out"],
                                 self.table, rows, coef=None if coef is None else coef.numpy(),
                                 fma=self.fma, sqrt=self.sqrt)

    def grad_sq_norm(self, weights: np.ndarray) -> torch.Tensor:
        s, _ = kt.grad_stats_table_reference(self.a["grad"], self.table, weights)
        return torch.tensor(s, dtype=torch.float64)


class _Upload:
    """Host rows -> a device tensor on torch's current stream without a host sync:
    two pinned staging buffers; one is rewritten only after the copy out of it (queued
    two uploads, i.e. a whole step, earlier: long done in practice) has finished."""

    def __init__(self, shape, dtype, device):
        self.dev = torch.empty(shape, dtype=dtype, device=device)
        self.pinned = [torch.empty(shape, dtype=dtype, pin_memory=True) for _ in range(2)]
        self.events = [torch.cuda.Event(), torch.cuda.Event()]  # unrecorded: no wait
        self.k = 0

    def __call__(self, host: np.ndarray) -> None:
        k = self.k = self.k ^ 1
        self.events[k].synchronize()  # that copy only, not the stream or the device
        self.pinned[k].numpy()[...] = host
        self.dev.copy_(self.pinned[k], non_blocking=True)
        self.events[k].record()


class CupyExecutor:
    """The table kernels on torch's current CUDA stream, over the state's memory
    wrapped for CuPy through DLPack (zero copy, once: the buffers never move)."""

    def bind(self, bufs: dict, table: kt.Table) -> None:
        import cupy

        self.cupy = cupy
        self.device = bufs["master"].device
        if self.device.type != "cuda":
            raise ValueError(f"CupyExecutor needs CUDA buffers, got {self.device}")
        self.dev_id = self.device.index if self.device.index is not None else torch.cuda.current_device()
        self.table = table
        with torch.cuda.device(self.dev_id), cupy.cuda.Device(self.dev_id), self._stream():
            self.a = {k: self._wrap(v) for k, v in bufs.items()}
            self.segs = cupy.asarray(table.segs)  # set-up: a synchronous upload is fine
            self.tiles = cupy.asarray(table.tiles)
            n = max(1, table.ntiles)
            self.scratch = (cupy.empty(n, np.float64), cupy.empty(n, np.int32))
            self.flag = cupy.empty(1, np.int32)
            self.rows = _Upload((table.nseg, kt.ROW_COLS), torch.float32, self.device)
            self.rows_cp = self._wrap(self.rows.dev)
            self.weights = _Upload((table.nseg,), torch.float64, self.device)
            self.weights_cp = self._wrap(self.weights.dev)
        self._weights_key = None

    def _stream(self):
        return cupy_stream(self.cupy, torch.cuda.current_stream(self.dev_id), self.dev_id)

    def _wrap(self, t: torch.Tensor | None):
        if t is None:
            return None
        if t.dtype == torch.bfloat16:  # CuPy has no bf16: the kernels take its bits
            t = t.view(torch.int16)
        return self.cupy.from_dlpack(t)

    def adamw(self, rows: np.ndarray, coef: torch.Tensor | None = None) -> None:
        with torch.cuda.device(self.dev_id), self.cupy.cuda.Device(self.dev_id), self._stream():
            self.rows(rows)
            a = self.a
            kt.adamw_table_step(a["master"], a["exp_avg"], a["exp_avg_sq"], a["grad"], a["out"],
                                self.segs, self.tiles, self.rows_cp,
                                None if coef is None else self.cupy.from_dlpack(coef.contiguous()))

    def grad_sq_norm(self, weights: np.ndarray) -> torch.Tensor:
        with torch.cuda.device(self.dev_id), self.cupy.cuda.Device(self.dev_id), self._stream():
            key = weights.tobytes()
            if key != self._weights_key:  # tp weights are fixed: uploaded once in practice
                self.weights(weights)
                self._weights_key = key
            res = torch.empty(1, dtype=torch.float64, device=self.device)
            kt.grad_stats_table(self.a["grad"], self.segs, self.tiles, self.weights_cp,
                                (self.cupy.from_dlpack(res), self.flag), self.scratch)
        return res.view(())
