"""SGD / Adagrad parity worker: stages x kinds on N ranks against single-process torch
(foreach=False) on the same global batch, gradient clipping on; plus a resume check per
case (saved after --split steps, loaded into a new engine, continued: bitwise the same
parameters as the uninterrupted run). Rank 0 writes per case max |param - reference|,
the losses, and the noise floor (the reference with the batch summed in N*GAS pieces)."""
from zerompi.runtime import pause_collector; pause_collector()
import json
import os

import torch
from mpi4py import MPI

import zerompi
from common import (global_batch, make_model, micro_slices, reference_run, resume_cases_parser, vocab_of,
                    whole_and_resumed)

HP = {"sgd": {"lr": 0.05, "momentum": 0.9, "dampening": 0.0, "nesterov": True, "weight_decay": 0.01},
      "sgd_damp": {"lr": 0.05, "momentum": 0.8, "dampening": 0.3, "nesterov": False, "weight_decay": 0.0},
      "adagrad": {"lr": 0.05, "lr_decay": 0.01, "weight_decay": 0.01, "initial_accumulator_value": 0.1, "eps": 1e-10}}
TORCH = {"sgd": torch.optim.SGD, "sgd_damp": torch.optim.SGD, "adagrad": torch.optim.Adagrad}

ap = resume_cases_parser()
ap.add_argument("--clip", type=float, default=0.5)
a = ap.parse_args()
world = MPI.COMM_WORLD
rank, N = world.rank, world.size
GAS, ROWS, SEQ = 2, 12 * N, 8


def reference(kind, micro):
    model = make_model("odd")
    losses, _, _ = reference_run(model, a.steps, ROWS, SEQ, HP[kind]["lr"], a.clip, micro,
                                 optimizer=lambda ps: TORCH[kind](ps, foreach=False, **HP[kind]))
    return {n: p.detach().clone() for n, p in model.named_parameters()}, losses


def engine_for(kind, stage):
    cfg = {"stage": stage, "gradient_accumulation_steps": GAS, "gradient_clipping": a.clip, "bucket_size": 300,
           "optimizer": dict(HP[kind], type=kind.split("_")[0])}
    return zerompi.initialize(make_model("odd"), cfg)


def train(engine, first, count, losses):
    for step in range(first, first + count):
        x, y = global_batch(step, ROWS, SEQ, vocab_of(engine.module))
        tot = 0.0
        for sl in micro_slices(ROWS, GAS, rank, N):
            _, loss = engine(x[sl], y[sl])
            engine.backward(loss)
            engine.step()
            tot += loss.item()
        losses.append(world.allreduce(tot, op=MPI.SUM) / (N * GAS))


result = {}
for case in a.cases.split(","):
    kind, stage = case.split(":")
    stage = int(stage)
    r = whole_and_resumed(lambda: engine_for(kind, stage), train, a.steps, a.split,
                          os.path.join(a.dir, case.replace(":", "-")))
    got, losses = r["state"], r["whole_record"]
    if rank == 0:
        ref, ref_losses = reference(kind, 1)
        floor_p, _ = reference(kind, GAS * N)
        result[case] = {"max_diff": max((got[n] - ref[n]).abs().max().item() for n in ref),
                        "floor": max((floor_p[n] - ref[n]).abs().max().item() for n in ref),
                        "losses": losses, "ref_losses": ref_losses, "resume_diff": r["diff"],
                        "optimizer": type(r["whole"].optimizer).__name__}
if rank == 0:
    with open(a.out, "w") as f:
        json.dump(result, f)
