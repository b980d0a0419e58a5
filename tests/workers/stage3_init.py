"""Partitioned construction under zerompi.Init and GatheredParameters."""
import argparse
import json

import torch
import torch.nn as nn
from mpi4py import MPI

import zerompi
from common import Shapes, global_batch, micro_slices
from zerompi.models.gpt import GPT, PRESETS

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("--mode", default="init")
a = ap.parse_args()
world = MPI.COMM_WORLD
rank, N = world.rank, world.size
cfg = {"stage": 3, "bucket_size": 256, "seed": 5}
res = {}

class RawInit(nn.Module):
    """Parameters whose constructor values are never touched by torch.nn.init: what each
    rank keeps at registration must be its own piece of exactly these values."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(37, 12))
        self.ramp = nn.Parameter(torch.arange(29, dtype=torch.float32))

    def forward(self, idx, targets):
        logits = self.table[idx] @ self.table.t() + self.ramp.sum() * 0
        return logits, nn.functional.cross_entropy(logits.view(-1, 37), targets.view(-1))


if a.mode == "init":
    for kind, build in (("gpt", lambda: GPT(PRESETS["tiny"])), ("shapes", Shapes), ("raw", RawInit)):
        torch.manual_seed(5)
        ref = build()
        with zerompi.Init(cfg):
            model = build()
        # nothing is held in full: every parameter's storage is empty, pieces are 1/N
        full_bytes = sum(p.untyped_storage().nbytes() for p in model.parameters())
        piece = sum(p._zero_init.piece.numel() for p in model.parameters())
        psi = sum(p.numel() for p in model.parameters())
        with zerompi.GatheredParameters(list(model.parameters())[:2]):
            early = [p.detach().clone() for p in list(model.parameters())[:2]]
        early_ok = all(torch.equal(e, r) for e, r in zip(early, list(ref.parameters())[:2]))
        eng = zerompi.initialize(model, cfg)
        sd = eng.full_state_dict(all_ranks=True)
        same = all(torch.equal(sd[n], p.detach()) for n, p in ref.named_parameters())
        # modify through GatheredParameters (rank 0's edit is broadcast) and check it lands
        target = next(p for p in model.parameters() if p.ndim == 2)
        tname = next(n for n, p in model.named_parameters() if p is target)
        with zerompi.GatheredParameters([target], engine=eng, modifier_rank=0):
            if rank == 0:
                with torch.no_grad():
                    target[0].fill_(0.25)
        after = eng.full_state_dict(all_ranks=True)
        edited = bool((after[tname][0] == 0.25).all()) and torch.equal(after[tname][1:], sd[tname][1:])
        x, y = global_batch(0, 2 * N, 16, 256 if kind == "gpt" else 37)
        (sl,) = micro_slices(2 * N, 1, rank, N)
        _, loss = eng(x[sl], y[sl])
        eng.backward(loss)
        eng.step()
        res[kind] = {"full_bytes": full_bytes, "piece": piece, "psi": psi, "early_ok": early_ok,
                     "same_as_normal_build": same, "edited": edited,
                     "materialized": eng.materialized_params(), "loss": loss.item()}
elif a.mode == "replicated":
    # stages 0-2 (bf16: a separate fp32 master): rank 0's edit inside GatheredParameters
    # must reach every rank's working copy and the master, and survive the next update
    for stage in (0, 1, 2):
        torch.manual_seed(5)
        model = GPT(PRESETS["tiny"])
        eng = zerompi.initialize(model, {"stage": stage, "precision": "bf16", "bucket_size": 256,
                                         "optimizer": {"lr": 1e-3}})
        tname, target = next((n, p) for n, p in model.named_parameters() if p.ndim == 2)
        before = eng.full_state_dict(all_ranks=True)
        with zerompi.GatheredParameters([target], engine=eng, modifier_rank=0):
            if rank == 0:
                with torch.no_grad():
                    target[0].fill_(0.25)
        after = eng.full_state_dict(all_ranks=True)
        working = bool((target[0] == 0.25).all())
        edited = bool((after[tname][0] == 0.25).all()) and torch.equal(after[tname][1:], before[tname][1:])
        others = all(torch.equal(after[n], before[n]) for n in before if n != tname)
        x, y = global_batch(0, 2 * N, 16, 256)
        (sl,) = micro_slices(2 * N, 1, rank, N)
        _, loss = eng(x[sl], y[sl])
        eng.backward(loss)
        eng.step()
        stepped = eng.full_state_dict(all_ranks=True)[tname][0]
        res[f"stage{stage}"] = {"working": working, "edited": edited, "others_unchanged": others,
                                "kept_after_step": bool(((stepped - 0.25).abs() < 0.01).all())}

if rank == 0:
    json.dump(res, open(a.out, "w"))
