"""The one error type for a bad config value, naming the dotted key as the user typed it."""
from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A bad config value. `key` is the dotted key from the table it was found in; a
    loader that nests the table re-raises with its own prefix (`optimizer.lr` becomes
    `zero.optimizer.lr` inside a TrainConfig), so the message names the key as the user
    typed it."""

    # Uncaught, it ends the job with one line from rank 0 and exit 2 (runtime/abort.py):
    # the ranks load the same config, so they raise it together.
    rank_0_speaks = True

    def __init__(self, key: str, value: Any, why: str):
        self.key, self.value, self.why = key, value, why
        super().__init__(f"config key '{key}' = {value!r}: {why}")

    def under(self, prefix: str) -> "ConfigError":
        return ConfigError(f"{prefix}.{self.key}" if prefix else self.key, self.value, self.why)


def fail(key: str, value: Any, why: str) -> None:
    raise ConfigError(key, value, why)
