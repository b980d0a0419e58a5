"""A DeepSpeed config's values, read through the one table (keys.py): DeepSpeed's
default where the file leaves a key out, the key as the user wrote it in every error,
and a record of what was read, so that no mapped key is silently dropped."""
from __future__ import annotations

import math
from typing import Any

from .keys import ABSENT, MAP, TABLE
from ..errors import ConfigError

AUTO = "auto"
_DTYPES = {"fp32": "fp32", "float32": "fp32", "float": "fp32", "torch.float32": "fp32", "fp16": "fp16",
           "float16": "fp16", "half": "fp16", "torch.float16": "fp16", "bf16": "bf16", "bfloat16": "bf16",
           "torch.bfloat16": "bf16"}


class Values:
    """The file's keys by table key, each read through the table (none goes unread)."""

    def __init__(self, flat: dict):
        self.flat, self.read = flat, set()

    def auto(self, key: str) -> bool:
        return key in self.flat and self.flat[key][1] == AUTO

    def given(self, key: str) -> bool:
        return key in self.flat and self.flat[key][1] != AUTO

    def name(self, key: str) -> str:
        return self.flat[key][0] if key in self.flat else key  # as the user wrote it

    def get(self, key: str, default: Any = ABSENT):
        """The file's value, else DeepSpeed's default from the table (ABSENT: none)."""
        assert TABLE[key].action == MAP, key
        self.read.add(key)
        if self.given(key):
            return self.flat[key][1]
        return TABLE[key].default if default is ABSENT else default

    def raw(self, key: str):
        """get, but "auto" as written."""
        value = self.get(key)
        return AUTO if self.auto(key) else value

    def number(self, key: str, default: Any = ABSENT, *, integer: bool = False, low: float = 0.0):
        v = self.get(key, default)
        bad = isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < low \
            or (integer and int(v) != v)
        if bad:
            raise ConfigError(self.name(key), v, f"expected {'an integer' if integer else 'a number'} >= {low:g}")
        return int(v) if integer else float(v)

    def dtype(self, key: str, precision: str) -> str:
        """A DeepSpeed dtype value as zerompi's "fp32" / "param" in a `precision` run;
        absent or null: the parameters' dtype, as DeepSpeed."""
        v = self.get(key)
        if v is ABSENT or v is None:
            return "param"
        d = _DTYPES.get(str(v))
        if d == "fp32":
            return "fp32"
        if d == precision:
            return "param"
        raise ConfigError(self.name(key), v, f"zerompi uses fp32 or the parameters' dtype ({precision}) here")
