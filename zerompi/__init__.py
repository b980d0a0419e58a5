"""zerompi: ZeRO (stages 0-3) over MPI for torch models.

    import zerompi
    engine = zerompi.initialize(model, {"stage": 2, "precision": "bf16"})
    loss = engine(x, y); engine.backward(loss); engine.step()
"""
from __future__ import annotations

from typing import Any, Sequence

from . import runtime
from .config import ZeroConfig, load as load_config

from .version import __version__

# An exception on any rank must end the whole MPI job (see runtime/abort.py). The hook only
# calls MPI_Abort when MPI is already initialised, so importing zerompi stays cheap.
runtime.install_abort_hook()


_U: Any = type("NotPassed", (), {"__repr__": lambda self: "<not passed>"})()  # DeepSpeed-call detection


def initialize(model=None, config: "ZeroConfig | dict | str | None" = None, *, dims: Any = None,
               param_groups: Sequence[dict] | None = None, args=_U, model_parameters=_U, training_data=_U,
               optimizer=_U, lr_scheduler=_U, collate_fn=_U, config_params=_U, mpu=_U,
               dist_init_required=_U, distributed_port=_U, mesh_param=_U):
    """Wrap `model` in a ZeRO engine for `config` (a ZeroConfig, dict, or JSON/TOML path,
    zerompi's or DeepSpeed's).

    `dims` is the job's process grid (zerompi.parallel.ParallelDims); by default it is
    built from the config over COMM_WORLD. ZeRO partitions over `dims.dp`.
    `param_groups` are torch-style groups ({"params": [...], "weight_decay": 0.0, ...});
    parameters not listed use the config's optimizer settings.

    Returns the engine, unless one of DeepSpeed's arguments (args, model_parameters,
    training_data, optimizer, lr_scheduler, collate_fn, config_params, mpu,
    dist_init_required, distributed_port, mesh_param) is passed: then, as
    deepspeed.initialize, (engine, optimizer, training_dataloader, lr_scheduler), and
    torch.distributed is initialised (unless dist_init_required=False). training_data:
    a dataset, each data-parallel rank's share of it in micro-batches, its position saved
    in the engine's checkpoints (zerompi/integrations/data.py). `optimizer` (a torch
    optimizer, its class or a factory) and `lr_scheduler` (a torch scheduler or a
    factory(optimizer); else the DeepSpeed config's scheduler block) become the engine's:
    zero/client_optim.py. Rule and details: zerompi/integrations/initialize.py.

    A bad or unfitting config value raises ConfigError naming the key as `config` spells
    it (`shard_group`, `comm.backend`), as deepspeed.initialize raises on a bad config;
    uncaught, it ends the MPI job with one line from rank 0 and exit 2, not a traceback
    per rank (runtime/abort.py). MPI starts here, under `comm.startup_timeout_s`
    (runtime/startup.py), unless the program started it already."""
    from .integrations import initialize as ds_init

    passed = dict(args=args, model_parameters=model_parameters, training_data=training_data,
                  optimizer=optimizer, lr_scheduler=lr_scheduler, collate_fn=collate_fn,
                  config_params=config_params, mpu=mpu, dist_init_required=dist_init_required,
                  distributed_port=distributed_port, mesh_param=mesh_param)
    return ds_init.run(model, config, dims, param_groups, {k: v for k, v in passed.items() if v is not _U})


def init_process_group(backend: str = "auto", **kwargs):
    """torch.distributed's default group over the MPI world (integrations/distributed.py)."""
    from .integrations.distributed import init_process_group as init

    return init(backend, **kwargs)


def init_distributed(dist_backend: str | None = None, **_ignored) -> None:
    """deepspeed.init_distributed's place: init_process_group(dist_backend or "auto")."""
    init_process_group(dist_backend or "auto")


def add_config_arguments(parser):
    """deepspeed.add_config_arguments's place: --deepspeed, --deepspeed_config (a
    config file for zerompi.initialize(args=...)), --local_rank (ignored)."""
    group = parser.add_argument_group("zerompi", "zerompi (DeepSpeed-compatible) configuration")
    group.add_argument("--deepspeed", default=False, action="store_true", help="accepted, ignored")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed or zerompi config file")
    group.add_argument("--local_rank", type=int, default=-1, help="accepted, ignored (MPI gives the rank)")
    return parser


_SUBMODULES = ("optim", "zero", "parallel", "checkpoint", "comm", "device", "precision", "data")


def __getattr__(name: str):
    # Lazy: importing zerompi must not initialise MPI or import the engine.
    if name in ("Init", "GatheredParameters"):
        from .zero import init_context

        return getattr(init_context, name)
    if name in _SUBMODULES:
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'zerompi' has no attribute {name!r}")


__all__ = ["initialize", "init_process_group", "init_distributed", "add_config_arguments", "Init", "GatheredParameters", "ZeroConfig", "load_config", "runtime",
           "__version__"]
