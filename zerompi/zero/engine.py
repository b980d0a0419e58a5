"""ZeroEngine: the object a training loop talks to, for every stage.

    engine = zerompi.initialize(model, {"stage": 2, "precision": "bf16"})
    for x, y in batches:                      # one micro-batch per call
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()                         # updates on every GAS-th call

The engine composes four parts; the stage picks them in one place (PARTS in layout.py) and no
other code looks at the stage number:
  state      ShardState (state.py): every buffer of model state, on one Placement
  params     ReplicatedParams | PartitionedParams (params.py, partitioned.py)
  reducer    GradReducer (grads.py): all-reduce | reduce-scatter at the boundary | per bucket
  optimizer  ShardedAdamW over the shard's segment table (optim/adamw.py)
Memory per rank and one step as data: docs/architecture.md.
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Sequence

import torch
import torch.nn as nn

from .. import config as config_mod
from .. import runtime
from ..runtime import watchdog
from ..config import ZeroConfig
from ..device import Placement
from ..optim import ShardedAdamW, build_groups, build_segments, host_fused
from ..parallel import activations
from ..precision import DTYPES, NonFinitePolicy, cast_inputs, make_scaler, reduce_dtype_of
from . import flat, grads, load_full, state_io
from . import groups as groups_mod
from . import layout as layout_mod
from . import offload as offload_mod
from .layout import PARTS
from .params import sync_untracked
from .state import ShardState
from .tensor_parallel_state import TPGrads, assemble_full


def _unique_params(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return list(model.named_parameters(remove_duplicate=True))


def _placement(named: list) -> Placement:
    devices = {p.device for _, p in named if p.device.type != "meta"}
    if len(devices) > 1:
        raise ValueError(f"the model's parameters are on several devices ({sorted(map(str, devices))}); "
                         "move the whole model to one device first")
    dev = devices.pop() if devices else torch.device("cpu")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"parameters on {dev}: zerompi trains on cpu or cuda devices")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return Placement(dev)


def _check_dims_device(dims, placement: Placement) -> None:
    """GPU tensors need communicators that move them; the grid is built per device."""
    if placement.is_cuda and not dims.dp.carries_gpu_tensors:
        raise ValueError(f"the model is on {placement.device} but the process grid's communicators "
                         "move host tensors only: build it with ParallelDims.from_config(config, "
                         "device=...) or let initialize() build it (dims=None)")


def _optimizer(segments, state: ShardState, groups: list[dict], n: int, impl: str, staged=()):
    """zero.optimizer.implementation: the table-driven fused kernels (one launch per
    step for the shard; on the host their numpy references) or torch ops per segment.
    Offloaded, fused means torch's fused CPU AdamW; the staged pipeline: zero/offload.py."""
    if state.staging:
        return offload_mod.host_optimizer(segments, state, groups, n, *staged)
    if state.offload:
        if (impl == "fused" or (impl == "auto" and state.placement.is_cuda)) and host_fused.available():
            return host_fused.HostFusedAdamW(segments, state.views, groups, n)
        return ShardedAdamW(segments, state.views, groups, n)
    if impl == "auto" and state.placement.is_cuda:
        try:
            import cupy  # noqa: F401
            impl = "fused"
        except ImportError:
            pass
    if impl == "fused":
        from ..optim.fused_adamw import FusedShardAdamW

        return FusedShardAdamW(segments, state, groups, n)
    return ShardedAdamW(segments, state.views, groups, n)


class ZeroEngine:
    def __init__(self, model: nn.Module, config: ZeroConfig | dict | str | None = None,
                 param_groups: Sequence[dict] | None = None, dims: Any = None):
        cfg = self.config = config_mod.load(config)
        runtime.fix_mmap_threshold()  # ZEROMPI_MALLOC=return: less RSS, slower steps (runtime/malloc.py)
        named = _unique_params(model)
        placement = _placement(named)  # the model's device: every buffer of state lives there
        if dims is None:
            from ..parallel import ParallelDims
            dims = ParallelDims.from_config(cfg, device=placement.device if placement.is_cuda else None)
        _check_dims_device(dims, placement)
        self.dims, self.comm = dims, dims.dp  # ZeRO partitions over the data-parallel group
        self.module = model
        self.rank, self.world = self.comm.rank, self.comm.size
        self.dtype = DTYPES[cfg.precision]
        self.mixed = self.dtype != torch.float32
        parts = self.parts = PARTS[cfg.stage]

        trainable = [(n, p) for n, p in named if p.requires_grad]
        if not trainable:
            raise ValueError("the model has no parameters with requires_grad=True")
        bucket, at_least = layout_mod.bucket(cfg, self.world, cfg.stage)
        plan = layout_mod.plan(model, trainable, cfg, cfg.stage, bucket, at_least)
        self.param_names = [n for n, _ in plan.order]
        self.params = [p for _, p in plan.order]
        groups, owner = build_groups(model, cfg.optimizer, param_groups)
        self.param_groups = groups
        group_of = [owner.get(id(p), 0) for p in self.params]

        # sync: one pickled allgather at set-up, so diverging ranks fail here, named
        runtime.check_same_everywhere(dims.world, config_mod.to_dict(cfg),
                                      [(n, tuple(p.shape)) for n, p in plan.order])
        # where states are partitioned (shard_group, comm.hierarchical; zero/groups.py): the
        # layout spans the K ranks of a shard group, replicated over N / K groups
        self.groups = sg = groups_mod.build(dims, cfg, cfg.stage)
        self.layout = layout = layout_mod.flat_layout(plan, sg.size, cfg, bucket, at_least, sg.replicas)
        own = layout_mod.owned(layout, cfg.stage, sg.shard_rank)
        self.state = layout_mod.shard_state(layout, own, placement, cfg.stage, cfg.precision,
                                            cfg.grad_accum_dtype, offload=cfg.offload_optimizer == "cpu",
                                            staging=offload_mod.staging_pairs(cfg, placement))
        self.param_store = parts.store(plan, self.params, self.param_names, layout, self.state,
                                       sg.shard, cfg, owns_all=parts.owns_all, groups=sg)
        sync_untracked(model, {id(p) for p in self.params}, self.comm, self.dtype)
        ac = cfg.activation_checkpointing  # ZeRO-R: block checkpoints, Pa over dims.tp (parallel/activations.py)
        self.activations = activations.apply(model, ac, dims.tp, placement) if ac.enabled else None

        self.optimizer = _optimizer(build_segments(layout, own, group_of), self.state, groups,
                                    len(self.params), cfg.optimizer.implementation, (cfg, dims))
        self.tp_grads = TPGrads(self.params, self.optimizer.segments, self.optimizer.views, dims.tp)
        self.scaler = make_scaler(cfg.precision, cfg.fp16)
        self.nonfinite = NonFinitePolicy(cfg.max_nonfinite_steps, cfg.precision, self.rank)
        self.reducer = grads.GradReducer(self.params, layout, sg.reduce, parts.reduction, self.state,
                                         cfg.bucket_count, reduce_dtype_of(cfg.precision, cfg.reduce_dtype),
                                         poll=self.param_store.serve)
        self.offload = offload_mod.attach(self)  # the staged offload pipeline, or None
        if self.param_store.serve is not None and dims.tp.size > 1:
            # tp collectives (tp layers, Pa gathers) inside forward/backward: a dp peer may
            # need this rank in a stage-3 round first (a cycle over dp x tp otherwise)
            dims.tp.set_idle(self.param_store.serve)
        self.micro_steps = 0      # engine.step() calls
        self.global_steps = 0     # optimizer updates applied
        self.skipped_steps = 0    # fp16 overflow skips
        self.last_grad_norm: float | None = None
        self._backward_pending = False
        self._state_fence = None  # an asynchronous checkpoint still copying the state (checkpoint/staging.py)
        runtime.seed_everything(cfg.seed, self.rank)
        runtime.release_free_memory()
        watchdog.watch_engine(self)  # deadlines from cfg.comm; names the step on expiry

    # ------------------------------------------------------------------ training API
    @property
    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    def is_boundary(self) -> bool:
        """True when the current micro-step ends with an optimizer update."""
        return (self.micro_steps + 1) % self.gradient_accumulation_steps == 0

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale

    def __call__(self, *args, **kwargs):
        if self.mixed:
            args, kwargs = cast_inputs(args, self.dtype), cast_inputs(kwargs, self.dtype)
        self.param_store.start_forward()
        # No try/finally: after an exception nothing may communicate (see backward).
        with self._explained():
            out = self.module(*args, **kwargs)
        self.param_store.finish_forward()
        return out

    @contextlib.contextmanager
    def _explained(self):
        """Re-raise torch's bare errors about released stage-3 parameters as ours."""
        try:
            yield
        except RuntimeError as e:
            better = self.param_store.explain(e)
            if better is None:
                raise
            raise type(better)(f"{better} [optimizer step {self.global_steps + 1}, "
                               f"micro-step {self.micro_steps + 1}]") from e

    def train(self, mode: bool = True) -> "ZeroEngine":
        self.module.train(mode)
        return self

    def eval(self) -> "ZeroEngine":
        return self.train(False)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch's loss (the mean over this rank's micro-batch)."""
        if self._backward_pending:
            raise RuntimeError("engine.backward() called twice without engine.step() in between")
        if loss.numel() != 1:
            raise ValueError(f"engine.backward expects a scalar loss, got shape {tuple(loss.shape)}")
        self._backward_pending = True
        contributions = self.world * self.gradient_accumulation_steps
        self.reducer.begin(reduce=self.reducer.every_micro_step or self.is_boundary(),
                           pre_scale=1.0 / contributions)
        self.param_store.start_backward()
        # No try/finally here: a rank whose backward raised must not go on to issue or
        # wait on collectives its peers will never match; the error goes straight to the
        # abort hook, which ends the whole job.
        with self._explained():
            (loss.float() * self.scaler.scale if self.scaler.scale != 1.0 else loss).backward()
        self.reducer.flush()
        self.param_store.finish_backward()  # sync: stage 3 ends its gather rounds together
        self.reducer.end()  # sync: waits for the last buckets' reductions

    def step(self) -> bool:
        """Count one micro-step; at the accumulation boundary update. True if updated."""
        if not self._backward_pending:
            raise RuntimeError("engine.step() called without engine.backward() for this micro-batch")
        self._backward_pending = False
        boundary = self.is_boundary()
        self.micro_steps += 1
        if not boundary:
            return False
        if self.offload is not None:
            return self.offload.step()  # zero/offload.py: norm, update and uploads of its own
        scale = self.scaler.scale
        if self.state.offload:
            self.state.offload_grads()  # sync (GPU): device -> host before the host update
        self.tp_grads.average_replicated()  # sync (tp > 1): replicas of norms/biases stay equal
        sumsq, used = self._grad_stats()
        overflow = not math.isfinite(sumsq)
        self.scaler.update(overflow)  # fp16: raises Diverged at min_scale
        # Logs every skip with its step; raises Diverged on every rank together.
        self.nonfinite.record(self.micro_steps // self.gradient_accumulation_steps, not overflow,
                              scale, self.scaler.scale)
        if overflow:
            self.skipped_steps += 1
            self.last_grad_norm = float("inf")
            self._zero_grads()
            return False
        norm = math.sqrt(sumsq) / scale
        self.last_grad_norm = norm
        coef = 1.0 / scale
        clip = self.config.gradient_clipping
        if clip > 0:
            # as torch.nn.utils.clip_grad_norm_: coefficient max/(norm+1e-6), clamped to 1
            clip_coef = clip / (norm + 1e-6)
            if clip_coef < 1.0:
                coef = float(torch.tensor(clip_coef, dtype=torch.float32)) * coef
        self._fence_state()
        self.optimizer.step(grad_coef=coef, used=used)
        self.param_store.after_update()  # sync: all-gather of the updated chunks
        self._zero_grads()
        self.global_steps += 1
        return True

    @property
    def offload_phases(self) -> dict:  # the last update's phases, threads, bytes (zero/offload.py)
        return self.offload.phases() if self.offload is not None else {}

    def _fence_state(self) -> None:
        """Before the master weights or moments change: wait until an asynchronous
        checkpoint's snapshot has copied them (a no-op once it has)."""
        fence, self._state_fence = self._state_fence, None
        if fence is not None:
            fence()

    def _grad_stats(self) -> tuple[float, list[bool]]:
        """Squared L2 norm of the (still loss-scaled) gradient over all ranks (float64),
        and which parameters got a gradient on any rank: one small all-reduce (over
        dp x tp: a tp rank's split parameters are distinct, replicas count once)."""
        # sync (GPU): the step's one host wait, for the overflow/clip decision below; under
        # the watchdog, since an NCCL collective stuck on a dead peer would block it for good
        norm_sq = self.optimizer.grad_sq_norm(self.tp_grads.weights)
        with watchdog.waiting("device sync (gradient norm)"):
            local = float(norm_sq)
        if self.parts.owns_all:
            local /= self.world  # every rank holds the whole reduced gradient
        else:
            local /= self.groups.replicas  # each shard is held by every replica group
        # sync: one float64 all-reduce; every rank decides overflow/clipping identically
        comm = self.comm if self.dims.tp_size == 1 else self.dims.world
        vals = comm.allreduce_scalars([local] + self.reducer.used)
        return vals[0], [v > 0 for v in vals[1:]]

    def _zero_grads(self) -> None:
        self.reducer.used = [0.0] * len(self.params)
        self.state.zero_grads()
        if self.state.flat_grad is not None:
            self.reducer.attach_grads()
        else:
            for p in self.params:
                p.grad = None

    # ------------------------------------------------------------------ introspection
    def full_state_dict(self, all_ranks: bool = False) -> dict[str, torch.Tensor]:
        """fp32 parameters keyed like model.named_parameters() (tied once) on rank 0
        (on every rank with all_ranks=True); an empty dict on the other ranks."""
        offload_mod.settle(self)
        tp, split = self.dims.tp, self.tp_grads.any_split
        tracked = self.param_store.full_state(all_ranks or split)
        if split:  # sync over tp: split parameters assembled at full shape, padding cut
            tracked = assemble_full(tracked, dict(zip(self.param_names, self.params)), tp,
                                    root_only=not all_ranks)
        if not (all_ranks or self.dims.rank == 0):
            return {}
        return {name: tracked[name] if name in tracked else p.detach().float().clone()
                for name, p in _unique_params(self.module)}

    def materialized_params(self) -> list[str]:
        """Names of trainable parameters whose full values exist on this rank now."""
        return self.param_store.materialized()

    def gathered(self, params, modifier_rank: int | None = None):
        """Temporary full access (zerompi.GatheredParameters(..., engine=engine))."""
        offload_mod.settle(self, write=modifier_rank is not None)
        if modifier_rank is not None:
            self._fence_state()
        return self.param_store.gathered(params, modifier_rank)

    def load_full_state_dict(self, state_dict: dict | None, strict: bool = True):
        """Full weights from rank 0's state_dict (others pass None), one tensor at a time."""
        offload_mod.settle(self, write=True)
        self._fence_state()
        return load_full.load_full_state_dict(self, state_dict, strict)

    def memory_report(self) -> dict[str, int]:
        """Bytes of model states this rank holds, by category, plus comm buffers."""
        rep = self.state.memory_report()
        rep["buffers"] = self.reducer.buffer_bytes()
        rep.update(self.param_store.memory_extra())
        rep.update(activations.memory_report(self.activations))  # peak kept checkpoint bytes (or arena)
        # Gradients autograd holds outside our buffers right now (between hooks).
        rep["loose_grads"] = sum(flat.nbytes(p.grad) for p in self.params
                                 if p.grad is not None and self.state.flat_grad is None)
        rep["numel"] = sum(self.layout.numels)
        rep["padded_numel"] = self.layout.total
        return rep

    def comm_stats(self) -> dict:
        return self.comm.stats()

    def reset_comm_stats(self) -> None:
        self.comm.reset_stats()

    # ------------------------------------------------------------------ checkpoints
    STATE_KINDS = state_io.STATE_KINDS

    def save_checkpoint(self, directory, tag: str | None = None, client_state: dict | None = None,
                        keep_last: int | None = None, async_save: bool = False):
        """Atomic HDF5-sharded checkpoint (see docs/checkpoints.md); returns its path.
        keep_last=K removes older checkpoints once this one is safely in place.
        async_save=True writes it in the background: zerompi.checkpoint.poll/flush publish it."""
        from .. import checkpoint

        return checkpoint.save(self, directory, tag=tag, client_state=client_state, keep_last=keep_last,
                               async_save=async_save)

    def load_checkpoint(self, directory, tag: str | None = None) -> dict | None:
        """Load the checkpoint `tag` (default: the 'latest' pointer) saved at any world
        size or stage; returns its client_state, or None when none exists."""
        from .. import checkpoint

        return checkpoint.load(self, directory, tag=tag)

    def export_state(self, views: bool = False) -> dict:
        offload_mod.settle(self)
        return state_io.export_state(self, views)

    def exported_elements(self) -> int:
        return state_io.exported_elements(self)

    def needed_pieces(self) -> list[tuple[str, tuple, int, int]]:
        return state_io.needed_pieces(self)

    def import_state(self, fetch, steps: dict, param_groups: list, scaler: dict, counters: dict) -> None:
        offload_mod.settle(self, write=True)
        self._fence_state()
        state_io.import_state(self, fetch, steps, param_groups, scaler, counters)

    def full_grads(self) -> dict[str, torch.Tensor]:
        return state_io.full_grads(self)
