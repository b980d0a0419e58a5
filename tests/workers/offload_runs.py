"""Runs of the staged offload pipeline for the delayed-update tests (tests/unit/test_offload.py
in one process, tests/workers/offload_delay.py on N ranks).

The reference applies the same one-step delay by hand to an engine without it: before
each optimizer step's micro-batches after the first, the working parameters are set to
what they were before the previous step (the device copy the delayed engine still
computes with), and left to the step, which in mixed precision reads only the master,
moments and gradients and rewrites every working element (uploads, all-gather)."""
from __future__ import annotations

import torch

import zerompi
from zerompi.models.gpt import GPT, PRESETS


def config(stage: int, delayed: bool, precision: str = "bf16", **offload) -> dict:
    return {"stage": stage, "precision": precision, "gradient_accumulation_steps": 2, "gradient_clipping": 0.5,
            "bucket_size": 3000, "offload_optimizer": "cpu", "optimizer": {"lr": 3e-3, "weight_decay": 0.1},
            "offload": {"pipeline": "staged", "delayed_update": delayed, "tile_elements": 5000, **offload}}


def working(engine) -> torch.Tensor:
    st = engine.state
    return st.flat_param if st.replicated else st.shard_param


def run(stage: int, delayed: bool, emulate: bool = False, steps: int = 5, rank: int = 0, world: int = 1,
        read_every_step: bool = False, device: str = "cpu", **offload) -> dict:
    """Losses, norms and the final fp32 parameters (rank 0) of a tiny GPT; emulate: the
    reference (no delay in the engine, the delay applied to its working parameters)."""
    torch.manual_seed(0)
    engine = zerompi.initialize(GPT(PRESETS["tiny"]).to(device), config(stage, delayed, **offload))
    gen = torch.Generator().manual_seed(1)
    losses, norms, stale = [], [], None
    for step in range(steps):
        if emulate:
            fresh = working(engine).clone()
            if stale is not None:
                working(engine).copy_(stale)  # the parameters before the previous update
            stale = fresh
        x = torch.randint(0, 256, (4 * world, 32), generator=gen).to(device)
        for micro in range(2):
            sl = slice((2 * rank + micro) * 2, (2 * rank + micro) * 2 + 2)
            _, loss = engine(x[sl], x[sl])
            engine.backward(loss)
            engine.step()
        losses.append(loss.item())
        norms.append(engine.last_grad_norm)
        if read_every_step:
            engine.full_state_dict()  # reads settle the host pass; must change nothing
    return {"losses": losses, "norms": norms, "params": engine.full_state_dict(), "engine": engine}
