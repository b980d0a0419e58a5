"""The training systems bench_gpu_e2e.py compares on one device, each built once and then
stepped on the same batches: plain torch, torch FSDP2, zerompi stages 0-3 and DeepSpeed
ZeRO-2/3, all at world size 1, the same GPT, the same AdamW hyper-parameters (lr 1e-4,
betas 0.9/0.95, weight decay 0.1) and clipping at global norm 1.

Names (--systems):
  torch            fp32 parameters, bf16 autocast, torch.optim.AdamW(fused=True on a GPU)
  fsdp2            torch.distributed.fsdp.fully_shard on every block and the root,
                   MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32), fp32
                   parameters, the same AdamW, clip_grad_norm_
  stageS           zerompi stage S (0-3), precision bf16
  deepspeedS       DeepSpeed ZeRO-S (2 or 3), bf16, the same torch AdamW as a client
                   optimizer (no JIT-built op); {"skipped": why} when deepspeed does not import
Every model is built on the device from the same seed: the same weights everywhere.
FSDP2 and DeepSpeed get a one-rank torch.distributed group (an in-process HashStore, NCCL on
a GPU, gloo on the CPU).
"""
from __future__ import annotations

import contextlib
import importlib
import logging
import os
import re
from dataclasses import dataclass, field
from typing import Callable

import torch

import harness  # noqa: F401  first: puts this checkout's zerompi on sys.path
import zerompi  # noqa: E402
from zerompi.models.gpt import GPT  # noqa: E402

LR, BETAS, WEIGHT_DECAY, CLIP = 1e-4, (0.9, 0.95), 0.1, 1.0
NAME = re.compile(r"^(torch|fsdp2|stage([0-3])|deepspeed([23]))$")


@dataclass
class System:
    name: str
    step: Callable  # step(x, y) -> loss, one optimizer step
    info: dict
    hold: list = field(default_factory=list)  # what keeps its memory alive

    def close(self) -> None:
        for obj in self.hold:
            destroy = getattr(obj, "destroy", None)  # DeepSpeed's engine removes its hooks
            if callable(destroy):
                destroy()
        self.hold.clear()
        self.step = None


def check_names(names: list[str]) -> None:
    bad = [n for n in names if not NAME.match(n)]
    if bad:
        raise ValueError(f"--systems: unknown system(s) {', '.join(bad)}; known: torch, fsdp2, stage0-3, "
                         "deepspeed2, deepspeed3")


def new_model(cfg, dev: torch.device) -> GPT:
    torch.manual_seed(0)
    with torch.device(dev):
        return GPT(cfg)


def batches(cfg, micro: int, seq: int, dev, n: int, corpus=None):
    """Random tokens, or windows of `corpus` (a 1-D int tensor) when given."""
    g = torch.Generator().manual_seed(0)
    for _ in range(n):
        if corpus is None:
            x = torch.randint(0, cfg.vocab_size, (micro, seq + 1), generator=g)
        else:
            starts = torch.randint(0, len(corpus) - seq - 1, (micro,), generator=g)
            x = torch.stack([corpus[i:i + seq + 1] for i in starts.tolist()])
        yield x[:, :-1].to(dev), x[:, 1:].to(dev)


def adamw(params, dev: torch.device) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY, fused=dev.type == "cuda")


def engine_config(backend: str, stage: int, lr: float = LR) -> dict:
    return {"stage": stage, "precision": "bf16", "gradient_clipping": CLIP,
            "optimizer": {"lr": lr, "betas": list(BETAS), "weight_decay": WEIGHT_DECAY},
            "comm": {"backend": backend}}


def process_group(dev: torch.device) -> None:
    """One-rank torch.distributed for FSDP2 and DeepSpeed, created once per process."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if dev.type == "cuda":
        torch.cuda.set_device(dev.index if dev.index is not None else torch.cuda.current_device())
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo binds to the hostname's address otherwise
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1)


def end_process_group() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def build(name: str, cfg, micro: int, backend: str, dev: torch.device) -> System | dict:
    """The system `name`, warm-up not included; {"skipped": why} for an absent peer."""
    m = NAME.match(name)
    if m is None:
        check_names([name])
    if name == "torch":
        return _torch(cfg, dev)
    if name == "fsdp2":
        return _fsdp2(cfg, dev)
    if m.group(2) is not None:
        return _zerompi(name, cfg, dev, backend, int(m.group(2)))
    return _deepspeed(name, cfg, dev, micro, int(m.group(3)))


def _torch(cfg, dev) -> System:
    model = new_model(cfg, dev)
    opt = adamw(model.parameters(), dev)
    step = _torch_step(model, opt, dev)
    return System("torch", step, {"optimizer": f"torch.optim.AdamW(fused={dev.type == 'cuda'})",
                                  "precision": "fp32 parameters, bf16 autocast"}, [model, opt])


def _torch_step(model, opt, autocast_dev):
    """A torch training step: forward (bf16 autocast on autocast_dev's type, if given),
    backward, clip_grad_norm_, the optimizer, grads set to None."""
    def step(x, y):
        with (torch.autocast(autocast_dev.type, dtype=torch.bfloat16) if autocast_dev is not None
              else contextlib.nullcontext()):
            _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss
    return step


def _fsdp2(cfg, dev) -> System:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    process_group(dev)
    mesh = init_device_mesh(dev.type, (1,))
    model = new_model(cfg, dev)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for blk in model.h:
        fully_shard(blk, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    opt = adamw(model.parameters(), dev)
    step = _torch_step(model, opt, None)  # the policy casts: no autocast
    return System("fsdp2", step, {"optimizer": f"torch.optim.AdamW(fused={dev.type == 'cuda'})",
                                  "precision": "fp32 parameters, MixedPrecisionPolicy(bf16, reduce fp32)",
                                  "backend": torch.distributed.get_backend()}, [model, opt])


def _zerompi(name, cfg, dev, backend, stage) -> System:
    model = new_model(cfg, dev)
    engine = zerompi.initialize(model, engine_config(backend, stage))

    def step(x, y):
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        return loss
    return System(name, step, {"optimizer": type(engine.optimizer).__name__,
                               "backend": type(engine.comm).__name__}, [engine, model])


def _deepspeed(name, cfg, dev, micro, stage) -> System | dict:
    if dev.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed
    except Exception as e:  # noqa: BLE001  absent or broken: the others still run
        return {"skipped": f"deepspeed does not import: {type(e).__name__}: {e}"}
    os.environ.setdefault("LOCAL_RANK", "0")  # DeepSpeed asserts a launcher set it
    deepspeed.utils.logger.setLevel(logging.WARNING)
    if dev.type == "cpu":
        # its CPU accelerator compiles a shared-memory allreduce (C++, minutes on a busy
        # 2-core machine) that one rank never uses; on a GPU no op is built
        # (the module by name: the attribute deepspeed.comm.torch is torch itself)
        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    process_group(dev)
    model = new_model(cfg, dev)
    conf = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1,
            "bf16": {"enabled": True}, "zero_optimization": {"stage": stage},
            "gradient_clipping": CLIP, "steps_per_print": 1 << 30}
    engine, *_ = deepspeed.initialize(model=model, optimizer=adamw(model.parameters(), dev), config=conf)

    def step(x, y):
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        return loss
    return System(name, step, {"optimizer": f"client torch.optim.AdamW(fused={dev.type == 'cuda'})",
                               "deepspeed": deepspeed.__version__, "precision": "bf16 parameters, fp32 master",
                               "backend": torch.distributed.get_backend()}, [engine, model])
