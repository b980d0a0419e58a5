"""ZeroEngine: the object a training loop talks to, for every stage.

    engine = zerompi.initialize(model, {"stage": 2, "precision": "bf16"})
    for x, y in batches:                      # one micro-batch per call
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()                         # updates on every GAS-th call

The engine composes four parts; the stage picks them in one place (PARTS in layout.py) and no
other code looks at the stage number:
  state      ShardState (state.py): every buffer of model state, on one Placement
  params     ReplicatedParams | PartitionedParams (params.py, stage3/store.py)
  reducer    GradReducer (grads.py): all-reduce | reduce-scatter at the boundary | per bucket
  optimizer  ShardedAdamW over the shard's segment table (optim/adamw.py)
Memory per rank and one step as data: docs/architecture.md.
"""
from __future__ import annotations

import contextlib
from typing import Any, Sequence

import torch
import torch.nn as nn

from .. import config as config_mod, runtime
from ..runtime import watchdog
from ..config import ZeroConfig
from ..optim import build_groups, build_segments, schedulers
from ..parallel import activations
from ..precision import DTYPES, NonFinitePolicy, cast_inputs, make_scaler, reduce_dtype_of
from . import build, calls, grads, load_full, outputs, state_io, step_coef
from . import groups as groups_mod
from . import layout as layout_mod
from . import offload as offload_mod
from .layout import PARTS
from .checkpoint_view import CheckpointView
from .params import sync_untracked
from .tensor_parallel_state import TPGrads, assemble_full


class ZeroEngine(calls.EngineFace):
    """Collective methods (every rank of the engine calls them, at the same point; checked:
    zero/calls.py): __call__, backward, step, full_state_dict, gathered, load_full_state_dict,
    save_checkpoint, load_checkpoint, full_grads."""

    lr_scheduler = None  # a torch scheduler stepped after each applied update (zerompi.initialize)
    def __init__(self, model: nn.Module, config: ZeroConfig | dict | str | None = None,
                 param_groups: Sequence[dict] | None = None, dims: Any = None):
        cfg = self.config = config_mod.load(config)
        runtime.fix_mmap_threshold()  # ZEROMPI_MALLOC=return: less RSS, slower steps (runtime/malloc.py)
        model, self._called = build.unwrap_compiled(model)  # torch.compile's wrapper: called, not named
        named = build.unique_params(model)
        placement = build.placement_of(named)  # the model's device: every buffer of state lives there
        if dims is None:
            from ..parallel import ParallelDims
            dims = ParallelDims.from_config(cfg, device=placement.device if placement.is_cuda else None)
        build.check_dims_device(dims, placement)
        self.dims, self.comm = dims, dims.dp  # ZeRO partitions over the data-parallel group
        self.module, self.rank, self.world = model, self.comm.rank, self.comm.size
        self.dtype = DTYPES[cfg.precision]
        self.mixed = self.dtype != torch.float32
        parts = self.parts = PARTS[cfg.stage]

        trainable = [(n, p) for n, p in named if p.requires_grad]
        if not trainable:
            raise ValueError("the model has no parameters with requires_grad=True")
        bucket, at_least = layout_mod.bucket(cfg, self.world, cfg.stage, device=placement.device.type)
        plan = layout_mod.plan(model, trainable, cfg, cfg.stage, bucket, at_least)
        self.param_names = [n for n, _ in plan.order]
        self.params = [p for _, p in plan.order]
        groups, owner = build_groups(model, cfg.optimizer, param_groups)
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
        sync_untracked(model, {id(p) for p in self.params}, self.comm, self.dtype, cfg.buffer_dtype)
        ac = cfg.activation_checkpointing  # ZeRO-R: block checkpoints, Pa over dims.tp (parallel/activations.py)
        self.activations = activations.apply(model, ac, dims.tp, placement) if ac.enabled else None

        self.optimizer = build.optimizer(build_segments(layout, own, group_of), self.state, groups, self.params,
                                         group_of, cfg.optimizer.implementation, (cfg, dims), bool(param_groups))
        self.tp_grads = TPGrads(self.params, self.optimizer.segments, self.optimizer.views, dims.tp)
        self.scaler = make_scaler(cfg.precision, cfg.fp16)
        self.nonfinite = NonFinitePolicy(cfg.max_nonfinite_steps, cfg.precision, self.rank)
        self.reducer = grads.GradReducer(self.params, layout, sg.reduce, parts.reduction, self.state,
                                         cfg.bucket_count, reduce_dtype_of(cfg.precision, cfg.reduce_dtype),
                                         poll=self.param_store.serve, local=self.world == 1)
        self.offload = offload_mod.attach(self)  # the staged offload pipeline, or None
        if self.param_store.serve is not None and dims.tp.size > 1:
            # tp collectives (tp layers, Pa gathers) inside forward/backward: a dp peer may
            # need this rank in a stage-3 round first (a cycle over dp x tp otherwise)
            dims.tp.set_idle(self.param_store.serve)
        self.micro_steps = 0      # engine.step() calls
        self._global_steps = 0    # optimizer updates applied
        self._skipped_steps = 0   # non-finite (fp16: overflow) skips
        self._last_grad_norm: float | None = None
        # GPU, static loss scale, fused optimizer: the step's norm and overflow are read a
        # step later (step_coef.py); fp16 needs the overflow at once (the scale).
        self.defer_stats = (placement.is_cuda and cfg.precision != "fp16"
                            and getattr(self.optimizer, "takes_device_coef", False))
        self._pending: step_coef.Pending | None = None
        self._backward_pending = False
        self._checkpoint = CheckpointView(self)  # what a checkpoint reads and sets (zero/checkpoint_view.py)
        runtime.seed_everything(cfg.seed, self.rank)
        runtime.release_free_memory()
        watchdog.watch_engine(self)  # deadlines from cfg.comm; names the step on expiry
        self._calls = calls.call_comm(dims)  # collective: the call checks' own communicator

    # ------------------------------------------------------------------ training API
    param_groups = property(lambda self: self.optimizer.param_groups, doc="torch-style groups (schedulers write lr)")

    # counters a device-decided step changes once read: each read settles it (zero/step_coef.py)
    @property
    def global_steps(self) -> int:
        self.settle()
        return self._global_steps

    @property
    def skipped_steps(self) -> int:
        self.settle()
        return self._skipped_steps

    @property
    def last_grad_norm(self) -> float | None:
        """The global gradient norm of the last update (inf: it was skipped)."""
        self.settle()
        return self._last_grad_norm

    @calls.collective("forward", check=False)
    def __call__(self, *args, **kwargs):
        """The model's forward, returning what the model returns. Collective."""
        if self.mixed:
            args, kwargs = cast_inputs(args, self.dtype), cast_inputs(kwargs, self.dtype)
        self.param_store.start_forward()
        # No try/finally: after an exception nothing may communicate (see backward).
        with self._explained():
            out = self._called(*args, **kwargs)
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
        self._called.train(mode)  # the wrapper's flag and its model's
        return self

    def eval(self) -> "ZeroEngine":
        return self.train(False)

    @calls.collective("backward", check=False)
    def backward(self, loss) -> None:
        """Backward of one micro-batch's loss (the mean over this rank's micro-batch): a
        tensor, or the model's whole output (zero/outputs.py finds the loss). Collective."""
        if self._backward_pending:
            raise RuntimeError("engine.backward() called twice without engine.step() in between")
        loss = outputs.find_loss(loss)
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

    @calls.collective("step", check=False)
    def step(self) -> bool:
        """Count one micro-step; at the accumulation boundary update. True if updated
        (defer_stats: issued; a non-finite norm read later makes it a skip after all). Collective."""
        if not self._backward_pending:
            raise RuntimeError("engine.step() called without engine.backward() for this micro-batch")
        self._backward_pending = False
        boundary = self.is_boundary()
        self.micro_steps += 1
        if not boundary:
            return False
        self.settle()  # the previous step's skip changes this step's counts
        if self.offload is not None:
            return self.offload.step()  # zero/offload.py: norm, update and uploads of its own
        if self.state.offload:
            self.state.offload_grads()  # sync (GPU): device -> host before the host update
        self.tp_grads.average_replicated()  # sync (tp > 1): replicas of norms/biases stay equal
        sumsq, used = self._grad_stats()
        coef = self._decide(sumsq, used)
        if self.defer_stats:
            self._fence_state()
            self.optimizer.step(used=used, device_coef=coef)
            self.param_store.after_update()  # sync: all-gather of the updated chunks
            self._zero_grads()
            return True
        updates, grad_coef = self._read_now()
        if updates:
            self._fence_state()
            self.optimizer.step(grad_coef=grad_coef, used=used)
            self.param_store.after_update()  # sync: all-gather of the updated chunks
        self._zero_grads()
        return updates

    def _decide(self, sumsq: torch.Tensor, used: list[bool]) -> torch.Tensor:
        """The kernel's [coef, skip] where the norm is; counted as made until read (_pending)."""
        coef, host_vals = step_coef.coefficient(sumsq, self.scaler.scale, self.reducer.unapplied,
                                                self.config.gradient_clipping)
        self._pending = step_coef.Pending(host_vals, self.micro_steps // self.gradient_accumulation_steps, used)
        self._global_steps += 1
        return coef

    def _read_now(self) -> tuple[bool, float]:
        """sync (GPU): the host reads the step's norm now; (update?, coefficient)."""
        with watchdog.waiting("device sync (gradient norm)"):
            norm, overflow, grad_coef = self._pending.read()
        return self._settle_read(norm, overflow, issued=False), grad_coef

    def settle(self) -> None:
        """Read the last step's norm and skip if not yet read (defer_stats: issued unread)."""
        if self._pending is not None:
            with watchdog.waiting("device sync (gradient norm of the last step)"):
                norm, overflow, _ = self._pending.read()
            self._settle_read(norm, overflow, issued=True)

    def _settle_read(self, norm: float, overflow: bool, issued: bool) -> bool:
        """The pending step's bookkeeping; True if it updates (issued and skipped: the
        kernel skipped it, its step counts are given back)."""
        p, self._pending = self._pending, None
        scale = self.scaler.scale
        self.scaler.update(overflow)  # fp16: raises Diverged at min_scale
        # Logs every skip with its step; raises Diverged on every rank together.
        self.nonfinite.record(p.step, not overflow, scale, self.scaler.scale)
        if overflow:
            self._skipped_steps += 1
            self._global_steps -= 1
            self._last_grad_norm = float("inf")
            if issued:
                self.optimizer.uncount_steps(p.used)
            return False
        return schedulers.applied(self, norm, issued)  # engine.lr_scheduler steps after the update

    offload_phases = property(lambda self: self.offload.phases() if self.offload is not None else {},
                              doc="The last update's phases, threads, bytes (zero/offload.py).")

    def _fence_state(self) -> None:
        """Before master or moments change: wait for an async checkpoint's snapshot."""
        fence = self._checkpoint.take_fence()
        if fence is not None:
            fence()

    def _grad_stats(self, local: torch.Tensor | None = None) -> tuple[torch.Tensor, list[bool]]:
        """Squared L2 norm of the stored (loss-scaled) gradient over all ranks (float64,
        where the state lives) and which parameters got a gradient on any rank (over dp x
        tp: split parameters are distinct, replicas count once). `local`: this rank's
        norm computed elsewhere (zero/offload.py). Alone: no communication."""
        if local is None:
            local = self.optimizer.grad_sq_norm(self.tp_grads.weights)
        norm_sq = local.reshape(1)
        comm = self.comm if self.dims.tp_size == 1 else self.dims.world
        if comm.size == 1:
            return norm_sq, [v > 0 for v in self.reducer.used]
        if self.parts.owns_all:
            norm_sq = norm_sq / self.world  # every rank holds the whole reduced gradient
        elif self.groups.replicas > 1:
            norm_sq = norm_sq / self.groups.replicas  # each shard is held by every replica group
        if norm_sq.is_cuda and comm.carries_gpu_tensors:
            # the norm on the device (no host wait); which parameters were used on the host
            comm.all_reduce(norm_sq)
            used = comm.allreduce_scalars(self.reducer.used)
            return norm_sq, [v > 0 for v in used]
        # sync (GPU with host-only groups): both in one float64 all-reduce on the host
        with watchdog.waiting("device sync (gradient norm)"):
            local = float(norm_sq)
        vals = comm.allreduce_scalars([local] + self.reducer.used)
        sumsq = torch.tensor([vals[0]], dtype=torch.float64, device=self.state.placement.device)
        return sumsq, [v > 0 for v in vals[1:]]

    def _zero_grads(self) -> None:
        schedulers.after_update(self)  # the boundary's update is done (or was skipped)
        self.reducer.used = [0.0] * len(self.params)
        self.state.zero_grads()
        if self.reducer.attaches:
            self.reducer.attach_grads()
        else:
            for p in self.params:
                p.grad = None

    # ------------------------------------------------------------------ introspection
    @calls.collective("full_state_dict")
    def full_state_dict(self, all_ranks: bool = False) -> dict[str, torch.Tensor]:
        """fp32 parameters keyed like model.named_parameters() (tied once) on rank 0
        (on every rank with all_ranks=True); an empty dict on the other ranks. Collective:
        every rank calls it (stage 3 and tp gather the parameters), not rank 0 alone."""
        offload_mod.settle(self)
        tp, split = self.dims.tp, self.tp_grads.any_split
        tracked = self.param_store.full_state(all_ranks or split)
        if split:  # sync over tp: split parameters assembled at full shape, padding cut
            tracked = assemble_full(tracked, dict(zip(self.param_names, self.params)), tp,
                                    root_only=not all_ranks)
        if not (all_ranks or self.dims.rank == 0):
            return {}
        return {name: tracked[name] if name in tracked else p.detach().float().clone()
                for name, p in build.unique_params(self.module)}

    def materialized_params(self) -> list[str]:
        """Names of trainable parameters held whole on this rank now, besides its shard
        (stages 0-2: every one; stage 3: the gathered units, none on one rank, where the
        shard is the whole model)."""
        return self.param_store.materialized()

    @calls.collective("gathered")
    def gathered(self, params, modifier_rank: int | None = None):
        """Temporary full access (zerompi.GatheredParameters(..., engine=engine)). Collective."""
        offload_mod.settle(self, write=modifier_rank is not None)
        if modifier_rank is not None:
            self._fence_state()
        return self.param_store.gathered(params, modifier_rank)

    @calls.collective("load_full_state_dict")
    def load_full_state_dict(self, state_dict: dict | None, strict: bool = True):
        """Full weights from rank 0's state_dict (others pass None), one tensor at a time. Collective."""
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
        rep["loose_grads"] = self.reducer.loose_grad_bytes()
        rep["numel"] = sum(self.layout.numels)
        rep["padded_numel"] = self.layout.total
        return rep

    # ------------------------------------------------------------------ checkpoints
    def checkpoint_view(self) -> CheckpointView:
        """The one object zerompi/checkpoint/ reads and sets this engine through."""
        return self._checkpoint

    @calls.collective("save_checkpoint", generous="checkpoint save")
    def save_checkpoint(self, directory, tag: str | None = None, client_state: dict | None = None,
                        keep_last: int | None = None, async_save: bool = False):
        """Atomic HDF5-sharded checkpoint (see docs/checkpoints.md); returns its path.
        keep_last=K removes older checkpoints once this one is safely in place.
        async_save=True writes it in the background: zerompi.checkpoint.poll/flush publish it. Collective."""
        from .. import checkpoint
        calls.require_boundary(self, "save_checkpoint")  # accumulated gradients are not saved
        return checkpoint.save(self, directory, tag=tag, client_state=calls.with_attached(self, client_state),
                               keep_last=keep_last, async_save=async_save)

    @calls.collective("load_checkpoint", generous="checkpoint load")
    def load_checkpoint(self, directory, tag: str | None = None) -> dict | None:
        """Load the checkpoint `tag` (default: the 'latest' pointer) saved at any world
        size or stage; returns its client_state, or None when none exists. Collective."""
        from .. import checkpoint

        return calls.restore_attached(self, checkpoint.load(self, directory, tag=tag))

    def export_state(self, views: bool = False) -> dict:
        offload_mod.settle(self)
        self.settle()  # a step the device decided: its skip changes the step counts
        return state_io.export_state(self, views)

    def exported_elements(self) -> int:
        return state_io.exported_elements(self)

    def import_state(self, fetch, steps: dict, param_groups: list, scaler: dict, counters: dict) -> None:
        offload_mod.settle(self, write=True)
        self.settle()  # a pending skip must not take back the loaded step counts later
        self._fence_state()
        state_io.import_state(self, fetch, steps, param_groups, scaler, counters)

    @calls.collective("full_grads")
    def full_grads(self) -> dict[str, torch.Tensor]:
        """The reduced gradients at full shape (tests, debugging). Collective."""
        return state_io.full_grads(self)
