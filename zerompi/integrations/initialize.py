"""`zerompi.initialize` with `deepspeed.initialize`'s contract (docs/migrating-from-deepspeed.md).

Which form answers: `zerompi.initialize(model, config)` returns the engine, as it always
has. A call that passes any of DeepSpeed's own arguments by keyword (args,
model_parameters, training_data, optimizer, lr_scheduler, collate_fn, config_params, mpu,
dist_init_required, distributed_port, mesh_param; None counts: it was passed) is a
DeepSpeed call and returns DeepSpeed's 4-tuple (engine, optimizer, training_dataloader,
lr_scheduler). `deepspeed.initialize(model=m, config=c)` with none of them would return
the tuple under DeepSpeed and the engine here: add `model_parameters=m.parameters()`.
"""
from __future__ import annotations

from collections.abc import Mapping


def run(model, config, dims, param_groups, ds: dict):
    """The body of zerompi.initialize; `ds`: the DeepSpeed arguments the call passed."""
    from ..config import load as load_config
    from ..zero.client_optim import engine_with
    from .. import runtime

    given = dict(ds)
    if model is None:
        raise TypeError("zerompi.initialize: model is required")
    config = _config_source(config, given)
    model_parameters, optimizer = given.get("model_parameters"), given.get("optimizer")
    if model_parameters is not None and optimizer is None:  # with an optimizer: its factory takes them
        if param_groups is not None:
            raise TypeError("zerompi.initialize: give model_parameters (DeepSpeed's name) or param_groups, not both")
        param_groups, model_parameters = _groups_of(model, model_parameters), None
    for name, what in (("mpu", "a Megatron model-parallel unit: zerompi builds its own dp x tp grid (config "
                        "tensor_parallel_size)"), ("mesh_param", "a device mesh: zerompi builds its own dp x tp "
                        "grid (config tensor_parallel_size)")):
        if given.get(name) is not None:
            raise NotImplementedError(f"zerompi.initialize: {name}= is not supported ({what})")
    # A DeepSpeed config's batch arithmetic is over the data-parallel ranks.
    cfg = load_config(config, dp_size=dims.dp_size if dims is not None else None)
    runtime.startup.import_mpi(cfg.comm.startup_timeout_s)  # MPI_Init under the config's deadline
    # the user's optimizer and scheduler, or the config's scheduler block (zero/client_optim.py)
    engine = engine_with(model, cfg, dims=dims, param_groups=param_groups, optimizer=optimizer,
                         lr_scheduler=given.get("lr_scheduler"), model_parameters=model_parameters,
                         config_source=config)
    if not given:
        return engine
    if given.get("dist_init_required", None) is not False:
        from .distributed import init_process_group

        init_process_group()  # DeepSpeed initialises torch.distributed too
    loader = None
    if given.get("training_data") is not None:
        from .data import ShardedLoader

        loader = ShardedLoader(given["training_data"], micro_batch_size(config, engine), engine,
                               collate_fn=given.get("collate_fn"), seed=cfg.seed)
    return engine, engine.optimizer, loader, engine.lr_scheduler


def _config_source(config, given: dict):
    args, params = given.get("args"), given.get("config_params")
    if params is not None:
        if config is not None:
            raise TypeError("zerompi.initialize: config and config_params are the same thing (DeepSpeed's old "
                            "name): give one")
        config = params
    from_args = getattr(args, "deepspeed_config", None) if args is not None else None
    if from_args is not None:
        if config is not None:
            raise TypeError(f"zerompi.initialize: a config was given both in args.deepspeed_config "
                            f"({from_args}) and as config=; give one (DeepSpeed refuses this too)")
        config = from_args
    return config


def _groups_of(model, model_parameters) -> list[dict]:
    """DeepSpeed's model_parameters (parameters, or torch param-group dicts) -> param_groups.
    zerompi trains every parameter with requires_grad=True: a list that leaves some out is
    refused (DeepSpeed would compute their gradients and never update them)."""
    import torch

    items = list(model_parameters)
    if not items:
        raise ValueError("zerompi.initialize: model_parameters is empty")
    if all(isinstance(g, Mapping) for g in items):
        groups = [dict(g) for g in items]
        for g in groups:
            g["params"] = list(g.get("params", ()))
        listed = [p for g in groups for p in g["params"]]
    elif all(isinstance(p, torch.Tensor) for p in items):
        groups, listed = None, items
    else:
        raise TypeError("zerompi.initialize: model_parameters must be parameters or param-group dicts "
                        "({'params': [...], 'lr': ...}), not a mix")
    ids = {id(p) for p in listed}
    left = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in ids]
    if left:
        raise ValueError(f"zerompi.initialize: model_parameters leaves out {len(left)} trainable parameter(s) "
                         f"({', '.join(left[:4])}{' ...' if len(left) > 4 else ''}); zerompi updates every "
                         "parameter with requires_grad=True: set requires_grad=False on those to freeze them")
    return groups


def micro_batch_size(config, engine) -> int:
    """train_micro_batch_size_per_gpu of a DeepSpeed config (or train_batch_size divided
    by accumulation and data-parallel ranks): the loader's batch size."""
    from ..config import ZeroConfig
    from ..config.loading import read_file

    data = config if isinstance(config, Mapping) else None
    if config is not None and not isinstance(config, (Mapping, ZeroConfig)):
        data = read_file(config)

    def number(key):
        v = (data or {}).get(key)
        return None if v in (None, "auto") else int(v)

    mb, tb = number("train_micro_batch_size_per_gpu"), number("train_batch_size")
    if mb is None and tb is not None:
        mb = tb // (engine.gradient_accumulation_steps * engine.dims.dp_size)
    if mb is None or mb < 1:
        raise ValueError("zerompi.initialize: training_data needs the micro-batch size: a DeepSpeed config's "
                         "train_micro_batch_size_per_gpu (or train_batch_size). With a zerompi config, build the "
                         "loader yourself: zerompi.integrations.data.ShardedLoader(dataset, batch_size, "
                         "engine=engine)")
    return mb
