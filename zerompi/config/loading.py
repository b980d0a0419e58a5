"""Loading a config: dicts, JSON/TOML files, CLI-style overrides -> the typed dataclasses of
zero.py, failing with the dotted key and value."""
from __future__ import annotations

import dataclasses
import json
import os
import tomllib
import types
import typing
from typing import Any, Mapping, Sequence

from .errors import ConfigError, fail
from .zero import ZeroConfig


def coerce(key: str, value: Any, tp: Any) -> Any:
    """Convert a JSON/TOML/CLI value to the annotated type or fail naming the key."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):  # e.g. int | str: the first that fits
        for arg in typing.get_args(tp):
            try:
                return coerce(key, value, arg)
            except ConfigError:
                pass
        fail(key, value, "expected " + " or ".join(a.__name__ for a in typing.get_args(tp)))
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, Mapping):
            fail(key, value, f"expected a table of {tp.__name__} fields")
        return _build(tp, value, key)
    if origin is tuple:
        args = typing.get_args(tp)
        if isinstance(value, str):
            value = [v for v in value.strip("()[] ").split(",") if v.strip()]
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            fail(key, value, f"expected {len(args)} values")
        return tuple(coerce(key, v, a) for v, a in zip(value, args))
    if tp is bool:
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "false", "0", "no"):
            return value.lower() in ("true", "1", "yes")
        if isinstance(value, bool):
            return value
        fail(key, value, "expected true or false")
    if tp is int:
        if isinstance(value, bool):
            fail(key, value, "expected an integer")
        if isinstance(value, str):
            try:
                value = float(value) if any(c in value for c in ".eE") else int(value, 0)
            except ValueError:
                fail(key, value, "expected an integer")
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if not isinstance(value, int):
            fail(key, value, "expected an integer")
        return value
    if tp is float:
        if isinstance(value, bool):
            fail(key, value, "expected a number")
        try:
            return float(value)
        except (TypeError, ValueError):
            fail(key, value, "expected a number")
    if tp is str:
        if not isinstance(value, str):
            fail(key, value, "expected a string")
        return value
    raise TypeError(f"unsupported config type {tp!r} for {key}")


def _build(cls: type, data: Mapping[str, Any], prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for k, v in data.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if k not in names:
            fail(key, v, f"unknown key (valid: {', '.join(sorted(names))})")
        kwargs[k] = coerce(key, v, hints[k])
    try:
        return cls(**kwargs)  # the section's own checks (__post_init__) name local keys
    except ConfigError as e:
        raise e.under(prefix) from None


def set_dotted(d: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    for p in parts[:-1]:
        sub = d.setdefault(p, {})
        if not isinstance(sub, dict):
            fail(dotted, value, f"'{p}' is not a table")
        d = sub
    d[parts[-1]] = value


def parse_overrides(items: Sequence[str]) -> dict[str, str]:
    """``["a.b=1", "--c.d", "2", "--e=3"]`` -> ``{"a.b": "1", "c.d": "2", "e": "3"}``."""
    out: dict[str, str] = {}
    i = 0
    items = list(items)
    while i < len(items):
        tok = items[i]
        name = tok[2:] if tok.startswith("--") else tok
        if "=" in name:
            k, v = name.split("=", 1)
        elif tok.startswith("--") and i + 1 < len(items):
            k, v = name, items[i + 1]
            i += 1
        else:
            raise ValueError(f"override {tok!r}: expected key=value or --key value")
        out[k.replace("-", "_")] = v
        i += 1
    return out


def read_file(path: str | os.PathLike) -> dict:
    """Read a JSON or TOML config file into a dict (error names the file)."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise ValueError(f"config file {path!r}: {e.strerror}") from None
    try:
        if path.endswith(".toml"):
            return tomllib.loads(raw.decode())
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"config file {path!r}: not valid {'TOML' if path.endswith('.toml') else 'JSON'}: {e}") from None


def _plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    return list(obj)


def load(source: "ZeroConfig | Mapping | str | os.PathLike | None" = None,
         overrides: "Mapping[str, Any] | Sequence[str] | None" = None, cls: type = None, *,
         dp_size: int | None = None):
    """Build a config (default ZeroConfig; any config dataclass via `cls`) from an
    instance, dict or file path plus dotted overrides. A DeepSpeed config (ZeroConfig
    only) is translated as DeepSpeed means it over `dp_size` data-parallel ranks
    (default: every rank), and rank 0 says what it turned into."""
    cls = ZeroConfig if cls is None else cls
    if source is None:
        data: dict = {}
    elif isinstance(source, cls):
        data = to_dict(source)
    elif isinstance(source, Mapping):
        # deep copy, tuples -> lists; nested section configs (OptimizerConfig(...)) -> dicts
        data = json.loads(json.dumps(source, default=_plain))
    else:
        data = read_file(source)
    ds = None
    if cls is ZeroConfig and not isinstance(source, cls):
        from . import deepspeed

        if deepspeed.looks_like_deepspeed(data):  # a DeepSpeed JSON config: translate it
            name = f"DeepSpeed config {os.fspath(source)}" if isinstance(source, (str, os.PathLike)) \
                else "DeepSpeed config"
            ds = deepspeed.translate(data, world_size=dp_size)
            data = ds.zero
    if overrides:
        if not isinstance(overrides, Mapping):
            overrides = parse_overrides(overrides)
        for k, v in overrides.items():
            set_dotted(data, k, v)
    cfg = _build(cls, data)
    if ds is not None:
        from .deepspeed.report import announce, effective

        announce(ds, name, [f"{name}, in effect: {effective(ds, cfg)}"], "zerompi")
    return cfg


def to_dict(cfg: Any) -> dict:
    """Any config dataclass as a plain nested dict (manifests, logs, cross-rank checks):
    the one serialisation; `load(to_dict(cfg), cls=type(cfg)) == cfg`."""
    return dataclasses.asdict(cfg)
