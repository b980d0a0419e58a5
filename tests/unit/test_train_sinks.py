"""The trainer's logging and compile keys in one process: a missing package or an unknown
backend is one error naming the key; TensorBoard events of a resumed run hold what
metrics.jsonl holds (the redone steps once, the new values)."""
import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest

from zerompi.config.errors import ConfigError
from zerompi.trainer import config as train_config


@pytest.mark.parametrize("key", ["tensorboard", "wandb"])
def test_a_logging_key_without_its_package_names_key_and_package(monkeypatch, key):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == key else real(name, *a))
    with pytest.raises(ConfigError, match=rf"'{key}' = True: needs the {key} package: pip install {key}"):
        train_config.load({key: True})


def test_compile_with_tensor_parallelism_is_refused():
    with pytest.raises(ConfigError, match=r"'compile' = True: is not supported with zero.tensor_parallel_size"):
        train_config.load({"compile": True, "zero": {"tensor_parallel_size": 2}})


def test_an_unknown_compile_backend_is_named():
    from zerompi.models.gpt import GPT, PRESETS
    from zerompi.trainer.compiling import compile_blocks

    with pytest.raises(ConfigError, match=r"'compile_backend' = 'no-such': is not a torch.compile backend here \(.*inductor"):
        compile_blocks(GPT(PRESETS["tiny"]), "no-such")


def test_tensorboard_events_of_a_resumed_run_follow_metrics(tmp_path: Path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from zerompi.trainer.sinks import Sinks

    cfg = SimpleNamespace(tensorboard=True, wandb=False)
    first = Sinks(cfg, tmp_path, 0, {})
    for step in range(1, 5):  # killed after step 4, its checkpoint at step 2
        first.log({"step": step, "loss": 10.0 + step, "updated": True, "checkpoints": ["x"]})
    first.close()
    again = Sinks(cfg, tmp_path, 2, {})  # resumed at step 2: steps 3 and 4 again, new values
    for step in range(3, 6):
        again.log({"step": step, "loss": 20.0 + step, "val_loss": 1.5})
    again.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert sorted(acc.Tags()["scalars"]) == ["loss", "val_loss"]  # no flags, lists or step
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(1, 11.0), (2, 12.0), (3, 23.0), (4, 24.0),
                                                                 (5, 25.0)]
