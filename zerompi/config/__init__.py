"""Configuration: ZeroConfig and its sections (zero.py), loading dicts / JSON / TOML /
overrides (loading.py), DeepSpeed JSON read as DeepSpeed means it (deepspeed/, by the
one key table in deepspeed/keys.py), and the one error type naming the dotted key
(errors.py). The trainer's TrainConfig builds on these: zerompi/trainer/config.py."""
from .errors import ConfigError, fail
from .loading import load, parse_overrides, read_file, to_dict
from .zero import (PRECISIONS, ActivationCheckpointingConfig, CommConfig, LossScaleConfig,
                   OffloadConfig, OptimizerConfig, Stage3Config, ZeroConfig)

__all__ = ["ConfigError", "fail", "load", "parse_overrides", "read_file", "to_dict", "PRECISIONS",
           "ActivationCheckpointingConfig", "CommConfig", "LossScaleConfig", "OffloadConfig", "OptimizerConfig",
           "Stage3Config", "ZeroConfig"]
