"""Dropping an engine frees what it built: the model, its shards, gradients and buffers.

torch keeps parameters' and activations' Python objects alive from C++, so a hook on a
tensor that refers back to the engine would make an uncollectable cycle (a 1B model's dropped
engines still held 24 GB on the GPU, benchmarks/results/gpu/h100-2026-11-27b). Users
building engines in one process (sweeps, notebooks, tests) would leak a model each."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch

import zerompi
from zerompi.models.gpt import GPT, PRESETS


def _step(engine, vocab: int) -> None:
    x = torch.randint(0, vocab, (2, 16))
    _, loss = engine(x, x)
    engine.backward(loss)
    engine.step()


@pytest.mark.parametrize("config", [
    {"stage": 0}, {"stage": 1, "precision": "bf16"}, {"stage": 2, "precision": "bf16"},
    {"stage": 3, "precision": "bf16"}, {"stage": 3, "precision": "fp16", "offload_optimizer": "cpu"},
    {"stage": 2, "gradient_accumulation_steps": 2},
], ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_a_dropped_engine_is_collected(config):
    cfg = PRESETS["tiny"]
    model = GPT(cfg)
    engine = zerompi.initialize(model, dict(config))
    for _ in range(engine.gradient_accumulation_steps):
        _step(engine, cfg.vocab_size)
    assert engine.global_steps == 1
    refs = {"engine": weakref.ref(engine), "model": weakref.ref(model),
            "state": weakref.ref(engine.state), "reducer": weakref.ref(engine.reducer)}
    del engine, model
    gc.collect()
    alive = [k for k, r in refs.items() if r() is not None]
    assert alive == [], f"still alive after the engine was dropped: {alive}"
