"""Shared pieces of the MPI test workers: test models, batches, the reference run."""
from __future__ import annotations

import argparse

import torch
import torch.nn as nn

import zoo

torch.set_num_threads(1)


class Odd(nn.Module):
    """Every shape users bring to stages 0-2: nested modules, odd sizes (not divisible by
    N), a frozen layer, a buffer, a root-level parameter, a scalar parameter, a parameter
    unused in the forward, and an embedding tied to the output projection."""

    def __init__(self, vocab: int = 37, dim: int = 13):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.5))             # root-level scalar
        self.emb = nn.Embedding(vocab, dim)
        self.body = nn.Sequential(nn.Linear(dim, 29), nn.GELU(),
                                  nn.Sequential(nn.Linear(29, dim), nn.LayerNorm(dim)))
        self.frozen = nn.Linear(dim, dim)
        self.frozen.requires_grad_(False)
        self.unused = nn.Linear(3, 5)                             # never called
        self.bias = nn.Parameter(torch.zeros(vocab))              # root-level vector
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight                        # tied
        self.register_buffer("mask", torch.ones(dim))

    def forward(self, idx, targets=None):
        h = self.emb(idx)
        h = h + self.body(h) * self.scale
        h = h + 0.1 * self.frozen(h) * self.mask.to(h.dtype)  # fp32 buffer (zero.buffer_dtype keep)
        logits = self.head(h).float() + self.bias.float()
        if targets is None:
            return logits
        return logits, nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


class Shapes(nn.Module):
    """Stage-3 shapes: a module called twice per forward, torch.utils.checkpoint inside
    the model, a tied embedding/head, a parameter used by the root's own forward, and a
    module never called."""

    def __init__(self, vocab: int = 37, dim: int = 12):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.block = nn.Sequential(nn.Linear(dim, dim), nn.Tanh())
        self.ckpt = nn.Sequential(nn.Linear(dim, 24), nn.GELU(), nn.Linear(24, dim))
        self.norm = nn.LayerNorm(dim)
        self.gate = nn.Parameter(torch.full((dim,), 0.5))
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight
        self.unused = nn.Linear(4, 4)

    def forward(self, idx, targets=None):
        from torch.utils.checkpoint import checkpoint

        h = self.emb(idx)
        h = self.block(self.block(h))
        h = h + checkpoint(self.ckpt, h, use_reentrant=False)
        h = self.norm(h) * self.gate
        logits = self.head(h).float()
        if targets is None:
            return logits
        return logits, nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def make_model(kind: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if kind == "odd":
        return Odd()
    if kind == "shapes":
        return Shapes()
    if kind in zoo.KINDS + zoo.LATE_KINDS:  # the models of issue 13, transformers ones included
        return zoo.make_zoo(kind, seed)
    if kind == "llama":
        from zerompi.models.llama import Llama, PRESETS as LLAMA

        return Llama(LLAMA["tiny"])
    if kind not in ("gpt", "tiny"):
        raise ValueError(f"unknown test model {kind!r}")
    from zerompi.models.gpt import GPT, PRESETS

    return GPT(PRESETS["tiny"])


def vocab_of(model: nn.Module) -> int:
    return model.emb.num_embeddings if hasattr(model, "emb") else model.config.vocab_size


def global_batch(step: int, rows: int, seq: int, vocab: int, device=None):
    g = torch.Generator().manual_seed(1000 + step)  # drawn on the CPU: the same batch anywhere
    x = torch.randint(0, vocab, (rows, seq), generator=g)
    y = torch.roll(x, -1, 1)
    return (x, y) if device is None else (x.to(device), y.to(device))


def micro_slices(rows: int, gas: int, rank: int, world: int) -> list[slice]:
    """Rows of micro-batch m for `rank`: the step's batch is cut into gas micro-batches,
    each split evenly across ranks (rows chosen divisible by gas * world)."""
    mb = rows // gas
    per = mb // world
    return [slice(m * mb + rank * per, m * mb + (rank + 1) * per) for m in range(gas)]


def reference_run(model: nn.Module, steps: int, rows: int, seq: int, lr: float, clip: float,
                  micro: int = 1, wd: float = 0.01, groups: bool = False, grad_step: int = 0,
                  device=None, optimizer=None):
    """Single-process torch.optim.AdamW (or `optimizer(params)`, whose own settings then
    stand for lr and wd) on the whole global batch; `micro` > 1 sums the same batch in
    that many pieces (same maths, other rounding: the noise floor)."""
    from zerompi.optim import decay_groups

    params = decay_groups(model, 0.1) if groups else [p for p in model.parameters() if p.requires_grad]
    opt = optimizer(params) if optimizer else torch.optim.AdamW(params, lr=lr, weight_decay=wd, foreach=False)
    losses, norms, grads0 = [], [], None
    for step in range(steps):
        x, y = global_batch(step, rows, seq, vocab_of(model), device)
        opt.zero_grad()
        total = 0.0
        for m in range(micro):
            sl = slice(m * rows // micro, (m + 1) * rows // micro)
            _, loss = model(x[sl], y[sl])
            (loss / micro).backward()
            total += loss.item() / micro
        params = [p for p in model.parameters() if p.requires_grad]
        if step == grad_step:
            grads0 = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"))
        norms.append(float(norm))
        opt.step()
        losses.append(total)
    return losses, norms, grads0


def resume_cases_parser() -> argparse.ArgumentParser:
    """The arguments of a worker that runs whole_and_resumed for each of --cases."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--cases", required=True, help="kind:stage,...")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--split", type=int, default=3)
    return ap


def whole_and_resumed(build, train, steps: int, split: int, path: str) -> dict:
    """The resume check of the workers: `build()` gives a new engine, `train(engine,
    first_step, count, record)` runs updates and appends what it records (losses, lrs) to
    `record`. One engine runs `steps` updates uninterrupted; another runs `split`, saves to
    `path`, and a third loads it and runs the rest. Returns the whole run's engine and
    full state and record, the resumed engine and record, and max |param difference|
    between the two runs over all ranks (0.0: bitwise the same)."""
    from mpi4py import MPI

    whole, whole_record = build(), []
    train(whole, 0, steps, whole_record)
    state = whole.full_state_dict(all_ranks=True)
    first, resumed_record = build(), []
    train(first, 0, split, resumed_record)
    first.save_checkpoint(path)
    del first
    again = build()
    again.load_checkpoint(path)
    assert again.global_steps == split
    train(again, split, steps - split, resumed_record)
    got = again.full_state_dict(all_ranks=True)
    diff = max((got[n] - state[n]).abs().max().item() for n in state)
    return {"whole": whole, "state": state, "whole_record": whole_record, "resumed": again,
            "resumed_record": resumed_record, "diff": MPI.COMM_WORLD.allreduce(diff, op=MPI.MAX)}
