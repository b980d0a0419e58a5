"""zerompi.initialize's `optimizer=` and `lr_scheduler=` (DeepSpeed's contract), in one
function, engine_with(), that builds the engine (docs/migrating-from-deepspeed.md).

optimizer: None (the config's optimizer block), a torch.optim.Optimizer instance built on
the model's parameters, an optimizer class, or a factory callable(params) -> optimizer
(the class and the factory are called on the trainable parameters, or model_parameters).
Its kind and per-group hyper-parameters become the engine's (zero.optimizer.type, the
param groups); the engine's optimizer is zerompi's partitioned one (optim/base.py):
  torch.optim.AdamW                      -> adamw (amsgrad, maximize refused)
  torch.optim.Adam                       -> adamw when weight_decay is 0 or decoupled_weight_decay
                                            (then the same update); L2 weight decay is refused
  torch.optim.SGD, torch.optim.Adagrad   -> sgd, adagrad (optim/elementwise.py; maximize refused)
  anything else                          -> refused, by name (LBFGS, Adafactor, LAMB, LARS, ...:
                                            their update needs whole-tensor statistics or a
                                            closure; or zerompi does not implement it)
lr_scheduler: None (then a DeepSpeed config's `scheduler` block, ds_schedules.py, if the
config has one), a torch scheduler (built on engine.optimizer, or on the optimizer instance
given here: it is moved onto engine.optimizer), or a factory callable(optimizer) ->
scheduler. It becomes engine.lr_scheduler, stepped by the engine after each applied update.
ReduceLROnPlateau needs a metric: the user steps it (it is refused here).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

import torch

from ..config.errors import ConfigError
from ..optim.adamw import KEYS_OF

KIND_OF = {"AdamW": "adamw", "Adam": "adamw", "SGD": "sgd", "Adagrad": "adagrad"}
REFUSED = {"LBFGS": "needs a closure and whole-tensor line searches",
           "Adafactor": "factors the second moment over whole rows and columns of each tensor",
           "LAMB": "scales each tensor's update by its whole-tensor trust ratio",
           "FusedLamb": "scales each tensor's update by its whole-tensor trust ratio",
           "LARS": "scales each tensor's update by its whole-tensor trust ratio",
           "SparseAdam": "updates sparse gradients"}


def engine_with(model, cfg, *, dims=None, param_groups=None, optimizer=None, lr_scheduler=None,
                model_parameters=None, config_source: Any = None):
    """The engine for `cfg` (a loaded ZeroConfig) with the user's optimizer and scheduler
    applied; config_source: what the user passed as config (its DeepSpeed `scheduler`
    block is read from there)."""
    from .engine import ZeroEngine

    extras: list[dict] = []
    if optimizer is not None:
        if param_groups is not None:
            raise ValueError("pass param_groups or optimizer, not both (the optimizer's groups are used)")
        cfg, param_groups, extras = from_torch(model, cfg, optimizer, model_parameters)
    elif model_parameters is not None and param_groups is None:
        param_groups = _groups_of(model_parameters)
    engine = ZeroEngine(model, cfg, dims=dims, param_groups=param_groups)
    for g, extra in zip(engine.optimizer.param_groups, extras):
        g.update(extra)  # a scheduler already built on the user's optimizer: its initial_lr etc.
    engine.lr_scheduler = attach(engine, lr_scheduler, optimizer, scheduler_block(config_source))
    return engine


def _groups_of(params) -> list[dict] | None:
    params = list(params)
    if params and isinstance(params[0], dict):
        return [dict(g) for g in params]
    return [{"params": params}] if params else None


def from_torch(model, cfg, optimizer, model_parameters=None):
    """(config with the optimizer's kind and defaults, param groups, per-group extra keys)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        params = model_parameters if model_parameters is not None else [p for p in model.parameters()
                                                                         if p.requires_grad]
        name = getattr(optimizer, "__name__", type(optimizer).__name__)
        if name in REFUSED:
            _refuse(name)
        made = optimizer(params)
        if not isinstance(made, torch.optim.Optimizer):
            raise TypeError(f"optimizer={name}: called on the parameters it returned a {type(made).__name__}, "
                            "not a torch.optim.Optimizer")
        optimizer = made
    name = type(optimizer).__name__
    if getattr(optimizer, "_zerompi_engine", False) or hasattr(optimizer, "segments"):
        raise ValueError("optimizer= is already a zerompi engine's optimizer; pass a torch optimizer")
    d = optimizer.defaults
    if name not in KIND_OF:
        _refuse(name)
    kind = KIND_OF[name]
    keys = KEYS_OF[kind]
    for flag in ("amsgrad", "maximize"):
        if d.get(flag):
            raise ValueError(f"optimizer={name}({flag}=True): zerompi's {name} has no {flag}")
    if name == "Adam" and not d.get("decoupled_weight_decay", False) and any(
            g.get("weight_decay", 0) for g in optimizer.param_groups):
        raise ValueError("optimizer=Adam with weight_decay > 0 adds L2 decay to the gradient, which is not "
                         "AdamW's decoupled decay zerompi implements; use torch.optim.AdamW (or Adam with "
                         "decoupled_weight_decay=True, or weight_decay=0)")
    impl = cfg.optimizer.implementation if kind == "adamw" else "auto"
    opt_cfg = dataclasses.replace(cfg.optimizer, type=kind, implementation=impl,
                                  **{k: _hyper(k, d[k]) for k in keys})
    cfg = dataclasses.replace(cfg, optimizer=opt_cfg)
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    covered = {id(p) for g in optimizer.param_groups for p in g["params"]}
    missing = [n for n, p in model.named_parameters() if id(p) in trainable and id(p) not in covered]
    if missing:
        raise ValueError(f"optimizer={name}: trainable parameters not in its param groups: {missing[:5]}"
                         f"{' ...' if len(missing) > 5 else ''} (add them, or set requires_grad=False)")
    groups, extras = [], []
    for g in optimizer.param_groups:
        groups.append({"params": [p for p in g["params"] if id(p) in trainable],
                       **{k: _hyper(k, g[k]) for k in keys}})
        extras.append({k: _num(v) for k, v in g.items() if k not in keys and k != "params"
                       and k not in d and isinstance(v, (int, float, torch.Tensor, tuple))})
    return cfg, groups, extras


def _hyper(k: str, v):
    if k == "betas":
        return tuple(float(b) for b in v)
    return bool(v) if k == "nesterov" else float(_num(v))


def _num(v):
    return float(v.item()) if isinstance(v, torch.Tensor) else v


def _refuse(name: str) -> None:
    why = REFUSED.get(name, "not an optimizer zerompi partitions (torch.optim.AdamW, Adam, SGD and "
                            "Adagrad are)")
    raise ValueError(f"optimizer={name}: {why}; zerompi refuses it rather than train differently")


def attach(engine, lr_scheduler, user_optimizer=None, block: Mapping | None = None):
    """engine.lr_scheduler from the lr_scheduler argument (or the config's block)."""
    opt = engine.optimizer
    if lr_scheduler is None:
        if block is None:
            return None
        from ..optim.ds_schedules import from_block
        return from_block(opt, block)
    if isinstance(lr_scheduler, type) or (callable(lr_scheduler) and not hasattr(lr_scheduler, "step")):
        lr_scheduler = lr_scheduler(opt)  # a factory, as DeepSpeed calls one: on the engine's optimizer
    if isinstance(lr_scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise ValueError("lr_scheduler=ReduceLROnPlateau needs a metric at each step: build it on "
                         "engine.optimizer and call scheduler.step(metric) in your loop instead")
    if not hasattr(lr_scheduler, "step"):
        raise TypeError(f"lr_scheduler: a {type(lr_scheduler).__name__}, not a scheduler (or a factory of one)")
    _rebind(lr_scheduler, opt)
    return lr_scheduler


def _rebind(sched, opt) -> None:
    """A scheduler built on the user's torch optimizer now drives engine.optimizer, whose
    groups (same order, same hyper-parameters, its keys copied over) the update reads."""
    for child in getattr(sched, "_schedulers", ()):  # SequentialLR, ChainedScheduler
        _rebind(child, opt)
    if getattr(sched, "optimizer", opt) is opt:
        return
    old = sched.optimizer
    if len(old.param_groups) != len(opt.param_groups):
        raise ValueError(f"lr_scheduler: built on an optimizer with {len(old.param_groups)} parameter groups, "
                         f"the engine's has {len(opt.param_groups)}: build it on engine.optimizer, or pass a "
                         "factory (lambda opt: Scheduler(opt, ...))")
    for mine, theirs in zip(opt.param_groups, old.param_groups):
        mine.update({k: v for k, v in theirs.items() if k != "params"})
    sched.optimizer = opt
    if hasattr(old.step, "_wrapped_by_lr_sched") and not hasattr(opt.step, "_wrapped_by_lr_sched"):
        # what torch's scheduler did to the old optimizer's step: without it torch warns
        # that step() was overridden
        step = type(opt).step

        def wrapped(*args, **kwargs):
            opt._opt_called = True
            return step(opt, *args, **kwargs)
        wrapped._wrapped_by_lr_sched = True
        opt.step = wrapped


def scheduler_block(source) -> Mapping | None:
    """The `scheduler` block of a DeepSpeed config given as a dict or a file path."""
    if isinstance(source, Mapping):
        data = source
    elif isinstance(source, (str, os.PathLike)):
        from ..config.loading import read_file
        data = read_file(source)
    else:
        return None
    from ..config.deepspeed import looks_like_deepspeed
    block = data.get("scheduler") if looks_like_deepspeed(data) else None
    if not isinstance(block, Mapping) or not block:
        return None
    if "type" not in block:
        raise ConfigError("scheduler.type", None, "missing (DeepSpeed needs it)")
    return block
