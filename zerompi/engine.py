"""ZeroEngine: the object a training loop talks to (stages 0, 1 and 2).

    engine = zerompi.initialize(model, {"stage": 2, "precision": "bf16"})
    for x, y in batches:                      # one micro-batch per call
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()                         # updates on every GAS-th call

Memory per rank (Psi = padded parameter elements, N = ranks, see docs/architecture.md):
  params   full low-precision flat buffer (stages 0-2)     2 or 4 bytes x Psi
  grads    stage 0/1: full flat buffer; stage 2: the shard
  master   fp32 shard (bf16/fp16 only; in fp32 the parameter shard is the master)
  moments  exp_avg + exp_avg_sq for the shard (stage 0: for everything)
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import torch
import torch.nn as nn

from . import config as config_mod
from . import flat, runtime
from .config import ZeroConfig
from .grads import GradReducer
from .optim import Segment, ShardedAdamW, build_groups
from .partition import Chunk, FlatLayout
from .precision import DTYPES, cast_inputs, make_scaler


def _unique_params(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return list(model.named_parameters(remove_duplicate=True))


class ZeroEngine:
    def __init__(self, model: nn.Module, config: ZeroConfig | dict | str | None = None,
                 comm: Any = None, param_groups: Sequence[dict] | None = None, dims: Any = None):
        cfg = config_mod.load(config)
        if cfg.stage == 3 and type(self) is ZeroEngine:
            raise ValueError("config key 'stage' = 3: use zerompi.initialize, which builds the stage-3 engine")
        self.config = cfg
        if dims is None:
            from .parallel import ParallelDims
            dims = ParallelDims.from_config(cfg)
        self.dims = dims
        self.comm = comm = dims.dp
        self.module = model
        self.rank, self.world = comm.rank, comm.size
        self.dtype = DTYPES[cfg.precision]
        self.mixed = self.dtype != torch.float32

        named = _unique_params(model)
        if any(p.device.type not in ("cpu", "meta") for _, p in named):
            raise ValueError("parameters must be on the CPU for the MPI backend (GPU path: comm.backend=nccl)")
        trainable = [(n, p) for n, p in named if p.requires_grad]
        if not trainable:
            raise ValueError("the model has no parameters with requires_grad=True")
        trainable, units = self._layout_order(model, trainable)
        self.param_names = [n for n, _ in trainable]
        self.params = [p for _, p in trainable]
        groups, owner = build_groups(model, cfg.optimizer, param_groups)
        self.param_groups = groups
        group_of = [owner.get(id(p), 0) for p in self.params]

        runtime.check_same_everywhere(comm, config_mod.to_dict(cfg),
                                      [(n, tuple(p.shape)) for n, p in trainable])
        self.layout = layout = FlatLayout([p.numel() for p in self.params], self.world,
                                          cfg.bucket_size, cfg.alignment, units=units)
        if cfg.stage == 0:  # plain DP: every rank "owns" every block
            self.own = [Chunk(k, s, e, s) for k, (s, e) in enumerate(layout.blocks)]
        else:
            self.own = layout.chunks(self.rank)
        owned = sum(c.size for c in self.own)
        self._init_storage(model, owned)
        self.exp_avg = torch.zeros(owned, dtype=torch.float32)
        self.exp_avg_sq = torch.zeros(owned, dtype=torch.float32)

        # One optimizer segment per owned piece of a parameter; padding is never updated.
        segments = []
        for ch in self.own:
            for pc in layout.pieces(ch.flat_lo, ch.flat_hi):
                a = ch.shard_lo + pc.flat_lo - ch.flat_lo
                b = a + pc.size
                master, grad, lowp = self._segment_views(pc.flat_lo, pc.flat_hi, a, b)
                segments.append(Segment(master, grad, self.exp_avg[a:b], self.exp_avg_sq[a:b],
                                        pc.index, pc.param_lo, group_of[pc.index], lowp))
        self.optimizer = ShardedAdamW(segments, groups, len(self.params))
        self.scaler = make_scaler(cfg.precision, cfg.fp16)
        reduce_dtype = torch.float32 if cfg.reduce_dtype == "fp32" else self.dtype
        self.reducer = GradReducer(self.params, layout, comm, min(cfg.stage, 2), self.own,
                                   self.flat_grad, self.grad_shard, cfg.bucket_count, reduce_dtype)
        self.micro_steps = 0      # engine.step() calls
        self.global_steps = 0     # optimizer updates applied
        self.skipped_steps = 0    # fp16 overflow skips
        self.last_grad_norm: float | None = None
        self._backward_pending = False
        runtime.seed_everything(cfg.seed, self.rank)
        runtime.release_free_memory()

    # ------------------------------------------------------------------ storage (stages 0-2)
    def _layout_order(self, model: nn.Module, trainable: list) -> tuple[list, list[int] | None]:
        """Parameters in flat-buffer order and their unit sizes (None: one unit).
        Backward order: the last registered parameter usually gets its gradient first."""
        return trainable[::-1], None

    def _init_storage(self, model: nn.Module, owned: int) -> None:
        """Full working parameters in one flat buffer, master/grads as the stage says."""
        layout = self.layout
        # Identical start on every rank: rank 0's fp32 values are broadcast once.
        full32 = flat.pack(self.params, layout, torch.float32)
        self.comm.broadcast(full32, root=0)
        self._sync_untracked(model, {id(p) for p in self.params})
        if self.mixed:
            self.flat_param = full32.to(self.dtype)
            self.master = torch.empty(owned, dtype=torch.float32)
            flat.gather_chunks(full32, self.own, self.master)
        else:
            self.flat_param, self.master = full32, None
        del full32
        flat.bind_params(self.params, self.flat_param, layout)
        grad_dtype = torch.float32 if self.config.grad_accum_dtype == "fp32" else self.dtype
        if self.config.stage in (0, 1):
            self.flat_grad, self.grad_shard = torch.zeros(layout.total, dtype=grad_dtype), None
        else:
            self.flat_grad, self.grad_shard = None, torch.zeros(owned, dtype=grad_dtype)

    def _segment_views(self, lo: int, hi: int, a: int, b: int):
        """(fp32 master, stored gradient, low-precision copy or None) of flat [lo, hi),
        which sits at shard [a, b)."""
        master = self.master[a:b] if self.mixed else self.flat_param[lo:hi]
        grad = self.grad_shard[a:b] if self.grad_shard is not None else self.flat_grad[lo:hi]
        return master, grad, (self.flat_param[lo:hi] if self.mixed else None)

    # ------------------------------------------------------------------ set-up helpers
    def _sync_untracked(self, model: nn.Module, tracked: set[int]) -> None:
        """Broadcast frozen parameters and buffers from rank 0; cast floating ones to the
        compute dtype, as module.to(dtype) would (DeepSpeed does the same)."""
        for p in model.parameters():
            if id(p) not in tracked:
                t = p.detach().float().contiguous()
                self.comm.broadcast(t, root=0)
                p.data = t.to(self.dtype)
        for mod in model.modules():
            for name, b in mod.named_buffers(recurse=False):
                if b is None:
                    continue
                t = b.detach().contiguous()
                self.comm.broadcast(t, root=0)
                if t.is_floating_point():
                    t = t.to(self.dtype)
                b.data = t

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
        return self.module(*args, **kwargs)

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
        # stages 2-3 reduce every micro-step into the gradient shard (no full gradient
        # survives a micro-step); stages 0-1 accumulate locally and reduce at the boundary
        every = self.config.stage >= 2
        self.reducer.begin(reduce=every or self.is_boundary(), pre_scale=1.0 / contributions)
        # No try/finally here: a rank whose backward raised must not go on to issue or
        # wait on collectives its peers will never match; the error goes straight to the
        # abort hook, which ends the whole job.
        (loss.float() * self.scaler.scale if self.scaler.scale != 1.0 else loss).backward()
        self.reducer.end()

    def step(self) -> bool:
        """Count one micro-step; at the accumulation boundary update. True if updated."""
        if not self._backward_pending:
            raise RuntimeError("engine.step() called without engine.backward() for this micro-batch")
        self._backward_pending = False
        boundary = self.is_boundary()
        self.micro_steps += 1
        if not boundary:
            return False
        scale = self.scaler.scale
        sumsq, used = self._grad_stats()
        overflow = not math.isfinite(sumsq)
        self.scaler.update(overflow)
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
        self.optimizer.step(grad_coef=coef, used=used)
        self._after_update()
        self._zero_grads()
        self.global_steps += 1
        return True

    def _grad_stats(self) -> tuple[float, list[bool]]:
        """Squared L2 norm of the (still loss-scaled) gradient over all ranks (float64),
        and which parameters got a gradient on any rank: one small all-reduce."""
        local = 0.0
        for s in self.optimizer.segments:
            local += float(torch.linalg.vector_norm(s.grad, dtype=torch.float64) ** 2)
        if self.config.stage == 0:
            local /= self.world  # every rank holds the whole reduced gradient
        vals = self.comm.allreduce_scalars([local] + self.reducer.used)
        return vals[0], [v > 0 for v in vals[1:]]

    def _after_update(self) -> None:
        """Refresh every rank's working parameters from the owners' updated shards."""
        self._all_gather_params()

    def _all_gather_params(self) -> None:
        if self.config.stage == 0:
            return
        handles = []
        for ch in self.own:
            s, e = self.layout.blocks[ch.block]
            handles.append(self.comm.all_gather(self.flat_param[ch.flat_lo:ch.flat_hi],
                                                self.flat_param[s:e], async_op=True))
        for h in handles:
            h.wait()

    def _zero_grads(self) -> None:
        self.reducer.used = [0.0] * len(self.params)
        if self.flat_grad is not None:
            self.flat_grad.zero_()
            self.reducer.attach_grads()
        else:
            self.grad_shard.zero_()
            for p in self.params:
                p.grad = None

    # ------------------------------------------------------------------ introspection
    def full_state_dict(self, all_ranks: bool = False) -> dict[str, torch.Tensor]:
        """fp32 parameters keyed like model.named_parameters() (tied once) on rank 0
        (on every rank with all_ranks=True); an empty dict on the other ranks."""
        if not self.mixed or self.config.stage == 0:
            full = self.master if (self.mixed and self.config.stage == 0) else self.flat_param
            full = full.float()
        else:
            gathered = torch.empty(self.world * self.layout.shard_size, dtype=torch.float32)
            self.comm.all_gather(self.master, gathered)
            full = flat.unshard(gathered.view(self.world, -1), self.layout)
        if not (all_ranks or self.rank == 0):
            return {}
        index = {id(p): i for i, p in enumerate(self.params)}
        out = {}
        for name, p in _unique_params(self.module):
            i = index.get(id(p))
            if i is None:
                out[name] = p.detach().float().clone()
            else:
                o, n = self.layout.offsets[i], self.layout.numels[i]
                out[name] = full[o:o + n].view(p.shape).clone()
        return out

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, directory, tag: str | None = None, client_state: dict | None = None,
                        keep_last: int | None = None):
        """Atomic HDF5-sharded checkpoint (see docs/checkpoints.md); returns its path.
        keep_last=K removes older checkpoints once this one is safely in place."""
        from . import checkpoint

        return checkpoint.save(self, directory, tag=tag, client_state=client_state, keep_last=keep_last)

    def load_checkpoint(self, directory, tag: str | None = None) -> dict | None:
        """Load the checkpoint `tag` (default: the 'latest' pointer) saved at any world
        size or stage; returns its client_state, or None when none exists."""
        from . import checkpoint

        return checkpoint.load(self, directory, tag=tag)

    # ------------------------------------------------------------------ state for checkpoints
    STATE_KINDS = ("param", "exp_avg", "exp_avg_sq")

    def export_state(self) -> dict:
        """This rank's share of the training state, by parameter name and element range.

        Returns {"pieces": [(name, shape, lo, hi)], "tensors": {kind: fp32 vector}} where
        piece j's values are tensors[kind][off_j : off_j + hi - lo] (offsets cumulative),
        plus "steps" {name: AdamW step}, "param_groups", "scaler", "counters". Each
        element is exported by exactly one rank (stage 0: rank 0 holds and writes all)."""
        segs = self.optimizer.segments if (self.config.stage > 0 or self.rank == 0) else []
        pieces = [(self.param_names[s.param], tuple(self.params[s.param].shape), s.param_lo,
                   s.param_lo + s.master.numel()) for s in segs]
        tensors = {}
        for kind in self.STATE_KINDS:
            parts = [getattr(s, "master" if kind == "param" else kind).float() for s in segs]
            tensors[kind] = torch.cat(parts) if parts else torch.empty(0)
        return {"pieces": pieces, "tensors": tensors,
                "steps": {n: self.optimizer.steps[i] for i, n in enumerate(self.param_names)},
                "param_groups": self.optimizer.state_dict()["param_groups"],
                "scaler": self.scaler.state_dict(),
                "counters": {"global_steps": self.global_steps, "micro_steps": self.micro_steps,
                             "skipped_steps": self.skipped_steps}}

    def needed_pieces(self) -> list[tuple[str, tuple, int, int]]:
        """(name, shape, lo, hi) of every parameter range this rank must load."""
        return [(self.param_names[s.param], tuple(self.params[s.param].shape), s.param_lo,
                 s.param_lo + s.master.numel()) for s in self.optimizer.segments]

    def import_state(self, fetch, steps: dict, param_groups: list, scaler: dict, counters: dict) -> None:
        """Load state saved by export_state (any world size or stage): fetch(kind, name,
        lo, hi) returns the fp32 values of that range. Then refreshes every rank's
        working parameters from the owners' masters."""
        if self._backward_pending:
            raise RuntimeError("load the checkpoint between steps, not after backward()")
        for s in self.optimizer.segments:
            name, hi = self.param_names[s.param], s.param_lo + s.master.numel()
            for kind in self.STATE_KINDS:
                getattr(s, "master" if kind == "param" else kind).copy_(fetch(kind, name, s.param_lo, hi))
            if s.lowp is not None:
                s.lowp.copy_(s.master)
        self.optimizer.steps = [int(steps[n]) for n in self.param_names]
        self.optimizer.load_state_dict({"steps": self.optimizer.steps, "param_groups": param_groups})
        self.scaler.load_state_dict(scaler)
        self.global_steps = int(counters["global_steps"])
        self.micro_steps = int(counters["micro_steps"])
        self.skipped_steps = int(counters.get("skipped_steps", 0))
        self._after_update()
        self._zero_grads()

    def full_grads(self) -> dict[str, torch.Tensor]:
        """The reduced, unscaled fp32 gradient of the global batch, keyed by parameter
        name, on every rank. Valid after the boundary micro-step's backward and before
        step() (for debugging and tests; it materialises the whole gradient)."""
        if self.config.stage == 0:
            full = self.flat_grad.float()
        else:
            if self.grad_shard is not None:
                shard = self.grad_shard.float()
            else:
                shard = torch.empty(self.layout.shard_size, dtype=torch.float32)
                flat.gather_chunks(self.flat_grad.float(), self.own, shard)
            gathered = torch.empty(self.world * self.layout.shard_size, dtype=torch.float32)
            self.comm.all_gather(shard, gathered)
            full = flat.unshard(gathered.view(self.world, -1), self.layout)
        full = full / self.scaler.scale
        return {n: full[o:o + k].view(p.shape).clone() for n, p, o, k in
                zip(self.param_names, self.params, self.layout.offsets, self.layout.numels)}

    def memory_report(self) -> dict[str, int]:
        """Bytes of model states this rank holds, by category, plus comm buffers."""
        rep = {
            "params": flat.nbytes(self.flat_param),
            "grads": flat.nbytes(self.flat_grad) + flat.nbytes(self.grad_shard),
            "master": flat.nbytes(self.master),
            "optimizer": flat.nbytes(self.exp_avg) + flat.nbytes(self.exp_avg_sq),
            "buffers": self.reducer.buffer_bytes(),
        }
        # Gradients autograd holds outside our buffers right now (stage 2 between hooks).
        rep["loose_grads"] = sum(flat.nbytes(p.grad) for p in self.params
                                 if p.grad is not None and self.flat_grad is None)
        rep["model_states"] = rep["params"] + rep["grads"] + rep["master"] + rep["optimizer"]
        rep["numel"] = sum(self.layout.numels)
        rep["padded_numel"] = self.layout.total
        return rep

    def comm_stats(self) -> dict:
        return self.comm.stats()

    def reset_comm_stats(self) -> None:
        self.comm.reset_stats()
