"""What ZeroEngine is built from, besides the layout (layout.py): the trainable
parameters once each, the placement their device gives every buffer, and the optimizer
over the shard's segments."""
from __future__ import annotations

import sys

import torch
import torch.nn as nn

from ..device import Placement
from ..optim import ShardedAdamW, elementwise, host_fused
from .state import ShardState


def unwrap_compiled(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """(the module the engine names, partitions and checkpoints, the module its forward
    calls). torch.compile(model) returns a wrapper holding the model as `_orig_mod`, so
    every name under it starts with `_orig_mod.`: the engine works on the model inside,
    so that checkpoints, full_state_dict and exports carry the model's own names and load
    across compiled and uncompiled runs, and calls the wrapper, so the forward stays
    compiled (the wrapper runs the inner module's hooks outside its graph)."""
    frame = sys.modules.get("torch._dynamo.eval_frame")  # not imported: nothing is compiled
    inner = model
    while frame is not None and isinstance(inner, frame.OptimizedModule):
        inner = inner._orig_mod
    return inner, model


def unique_params(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return list(model.named_parameters(remove_duplicate=True))


def placement_of(named: list) -> Placement:
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


def check_dims_device(dims, placement: Placement) -> None:
    """GPU tensors need communicators that move them; the grid is built per device."""
    if placement.is_cuda and not dims.dp.carries_gpu_tensors:
        raise ValueError(f"the model is on {placement.device} but the process grid's communicators "
                         "move host tensors only: build it with ParallelDims.from_config(config, "
                         "device=...) or let initialize() build it (dims=None)")


def optimizer(segments, state: ShardState, groups: list[dict], params, group_of, impl: str, staged=(),
              user_groups: bool = False):
    """The engine's torch.optim.Optimizer over the shard (optim/base.py), its groups holding
    `params` (group_of: each one's group). zero.optimizer.implementation: the table-driven fused kernels (one launch per
    step for the shard; on the host their numpy references) or torch ops per segment.
    Offloaded, fused means torch's fused CPU AdamW; the staged pipeline: zero/offload.py
    (staged: its (config, dims))."""
    kind = staged[0].optimizer.type if staged else "adamw"
    if kind == "adamw":
        opt = _adamw(segments, state, groups, len(params), impl, staged)
    else:  # SGD, Adagrad: torch ops per segment (optim/elementwise.py)
        opt = elementwise.KINDS[kind](segments, state.views, groups, len(params))
    opt.attach_params(params, group_of, hide_empty_default=user_groups)
    return opt


def _adamw(segments, state: ShardState, groups: list[dict], n: int, impl: str, staged):
    if state.staging:
        from . import offload

        return offload.host_optimizer(segments, state, groups, n, *staged)
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
