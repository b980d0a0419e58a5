"""DeepSpeed optimizer blocks of torch's SGD and Adagrad onto zero.optimizer (type sgd /
adagrad, zerompi/optim/elementwise.py): DeepSpeed passes their params to torch's class, so
torch's defaults apply; keys of another optimizer are refused, named."""
from __future__ import annotations

from .keys import MAP, lookup
from .values import Values
from ..errors import ConfigError

ELEMENTWISE = ("sgd", "adagrad")
_ELEMENTWISE_KEYS = {"sgd": ("lr", "momentum", "dampening", "nesterov", "weight_decay"),
                     "adagrad": ("lr", "lr_decay", "weight_decay", "initial_accumulator_value", "eps")}


def only(ctx: Values, names, what: str) -> None:
    """A mapped optimizer.params key of another optimizer: refused, named."""
    for key in ctx.flat:
        n = key.rpartition(".")[2]
        if key.startswith("optimizer.params.") and lookup(key).action == MAP and n not in names:
            raise ConfigError(ctx.name(key), ctx.flat[key][1], f"not a parameter of {what}")


def elementwise(ctx: Values, t, kind: str) -> dict:
    """SGD / Adagrad with torch's defaults (DeepSpeed passes the params to torch's class)."""
    opt: dict = {"type": kind}
    only(ctx, _ELEMENTWISE_KEYS[kind], "torch.optim." + ("SGD" if kind == "sgd" else "Adagrad"))
    for n in _ELEMENTWISE_KEYS[kind]:
        key = f"optimizer.params.{n}"
        if ctx.auto(key):
            continue
        if n == "nesterov":
            v = ctx.get(key, False)
            if not isinstance(v, bool):
                raise ConfigError(ctx.name(key), v, "expected true or false")
            opt[n] = v
            continue
        default = {"lr": 0.01 if kind == "adagrad" else 1e-3, "eps": 1e-10, "weight_decay": 0.0}.get(n, 0.0)
        opt[n] = ctx.number(key, default, low=1e-300 if n == "eps" else 0.0)
        if n == "lr":
            t.lr_key, t.lr_default = ctx.name(key), not ctx.given(key)
    return opt
