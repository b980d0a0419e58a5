"""torch.compile as users apply it, against the same engine uncompiled: per block
(`block.compile()` on each repeated block, torchtitan's way) and the whole model
(`torch.compile(model)`; warm: and run once before `zerompi.initialize`), each at the
stages asked for, in one process (a case may reuse
the graphs an earlier one compiled, as a second model of the same classes does). Writes,
per case, the losses, the graphs compiled so far after each step (a recompile adds
graphs), the calls of compiled graphs, the largest difference of the final fp32 parameters
from the eager run of its stage, and whether their names are the eager run's.

Backend: a counting wrapper around --backend (aot_eager in the tests: the point is which
graphs are captured and what they compute, not inductor's code; inductor's own run is
tests/system/test_train_compile.py)."""
from __future__ import annotations

import argparse
import json

import torch
import torch._dynamo
from mpi4py import MPI

import zerompi
from zerompi.models.gpt import GPT, PRESETS

torch.set_num_threads(1)
STEPS = 2


def run(stage: int, mode: str, backend) -> dict:
    torch.manual_seed(0)
    model = GPT(PRESETS["tiny"])
    if mode == "block":
        for blk in model.h:
            blk.compile(backend=backend)
    elif mode in ("whole", "warm"):
        model = torch.compile(model, backend=backend)
        if mode == "warm":  # a forward before initialize, as in training: a graph without the engine's hooks
            warm = torch.zeros(2, 16, dtype=torch.long)
            model(warm, warm)
    engine = zerompi.initialize(model, {"stage": stage, "optimizer": {"lr": 1e-2}})
    g = torch.Generator().manual_seed(1 + MPI.COMM_WORLD.rank)
    losses, graphs, calls0 = [], [], backend.calls
    for _ in range(STEPS):
        x = torch.randint(0, 256, (2, 16), generator=g)
        _, loss = engine(x, x)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        graphs.append(backend.graphs)
    with torch.no_grad():  # an evaluation forward (no grad): its own graphs, then back to training
        engine.eval()
        _, val = engine(x, x)
        engine.train()
    full = engine.full_state_dict()  # a whole compiled model's names too: no _orig_mod. (same_names)
    return {"losses": losses, "val": val.item(), "graphs": graphs, "full": full,
            "calls": backend.calls - calls0}


class Counting:
    """The backend, counting the graphs it compiles and the calls of compiled graphs (a
    case whose model reuses graphs compiled for an earlier case still counts calls)."""

    def __init__(self, name: str):
        self.fn, self.graphs, self.calls = torch._dynamo.lookup_backend(name), 0, 0

    def __call__(self, gm, inputs):
        self.graphs += 1
        compiled = self.fn(gm, inputs)

        def counted(*args):
            self.calls += 1
            return compiled(*args)
        return counted


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--backend", default="aot_eager")
    ap.add_argument("--cases", default="block:0,block:1,block:2,block:3,whole:1,whole:2,whole:3,warm:3")
    a = ap.parse_args()
    out, eager, backend = {}, {}, Counting(a.backend)
    for case in a.cases.split(","):
        mode, stage = case.split(":")
        stage = int(stage)
        if stage not in eager:
            eager[stage] = run(stage, "eager", backend)
        r = run(stage, mode, backend)
        ref = eager[stage]
        diff = max(((r["full"][k] - v).abs().max().item() for k, v in ref["full"].items()), default=0.0)
        out[case] = {"losses": r["losses"], "eager_losses": ref["losses"], "val": r["val"],
                     "eager_val": ref["val"], "graphs": r["graphs"], "calls": r["calls"], "param_diff": diff,
                     "same_names": sorted(r["full"]) == sorted(ref["full"])}
    if MPI.COMM_WORLD.rank == 0:
        with open(a.out, "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    main()
