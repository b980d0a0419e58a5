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


def initialize(model, config: "ZeroConfig | dict | str | None" = None, *, dims: Any = None,
               param_groups: Sequence[dict] | None = None, optimizer: Any = None, lr_scheduler: Any = None,
               model_parameters: Any = None):
    """Wrap `model` in a ZeRO engine for `config` (a ZeroConfig, dict, or JSON/TOML path).

    `dims` is the job's process grid (zerompi.parallel.ParallelDims); by default it is
    built from the config over COMM_WORLD. ZeRO partitions over `dims.dp`.
    `param_groups` are torch-style groups ({"params": [...], "weight_decay": 0.0, ...});
    parameters not listed use the config's optimizer settings.
    `optimizer` (a torch optimizer, its class or a factory) and `lr_scheduler` (a torch
    scheduler or a factory(optimizer)) as deepspeed.initialize takes them: zero/client_optim.py;
    the scheduler becomes engine.lr_scheduler, stepped after each applied update.

    A bad or unfitting config value raises ConfigError naming the key as `config` spells
    it (`shard_group`, `comm.backend`), as deepspeed.initialize raises on a bad config;
    uncaught, it ends the MPI job with one line from rank 0 and exit 2, not a traceback
    per rank (runtime/abort.py). MPI starts here, under `comm.startup_timeout_s`
    (runtime/startup.py), unless the program started it already."""
    from .zero.client_optim import engine_with

    # A DeepSpeed config's batch arithmetic is over the data-parallel ranks.
    cfg = load_config(config, dp_size=dims.dp_size if dims is not None else None)
    runtime.startup.import_mpi(cfg.comm.startup_timeout_s)  # MPI_Init under the config's deadline
    return engine_with(model, cfg, dims=dims, param_groups=param_groups, optimizer=optimizer,
                       lr_scheduler=lr_scheduler, model_parameters=model_parameters, config_source=config)


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


__all__ = ["initialize", "Init", "GatheredParameters", "ZeroConfig", "load_config", "runtime",
           "__version__"]
