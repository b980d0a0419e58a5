"""LR schedulers on N ranks: for each (schedule, stage) case, an uninterrupted run of
--steps updates (accumulation 2) and a run saved after --split updates, loaded into a new
engine with a new scheduler and continued. Rank 0 writes per case: the lrs of every update
of both runs, the same schedule's lrs on a plain torch AdamW (torch's / DeepSpeed's
formula), and max |param difference| between the two runs (every rank's view agrees)."""
from zerompi.runtime import pause_collector; pause_collector()
import json
import os

import torch
from mpi4py import MPI

import zerompi
from zerompi.optim import ds_schedules
from common import global_batch, make_model, micro_slices, resume_cases_parser, vocab_of, whole_and_resumed

L = torch.optim.lr_scheduler
TORCH = {
    "LambdaLR": lambda o: L.LambdaLR(o, lambda s: 1.0 / (1 + s)),
    "OneCycleLR": lambda o: L.OneCycleLR(o, max_lr=0.02, total_steps=8),
    "CosineAnnealingLR": lambda o: L.CosineAnnealingLR(o, T_max=4, eta_min=1e-4),
    "SequentialLR": lambda o: L.SequentialLR(o, [L.LinearLR(o, 0.2, 1.0, total_iters=2), L.ExponentialLR(o, 0.7)],
                                             milestones=[2]),
}
DS = {
    "WarmupLR": {"warmup_min_lr": 1e-4, "warmup_num_steps": 3},
    "WarmupDecayLR": {"total_num_steps": 6, "warmup_max_lr": 0.005, "warmup_num_steps": 2, "warmup_type": "linear"},
    "WarmupCosineLR": {"total_num_steps": 6, "warmup_num_steps": 2, "warmup_min_ratio": 0.1},
    "OneCycle": {"cycle_min_lr": 1e-4, "cycle_max_lr": 0.01, "cycle_first_step_size": 2, "decay_step_size": 1,
                 "decay_lr_rate": 0.5},
}

a = resume_cases_parser().parse_args()
world = MPI.COMM_WORLD
rank, N = world.rank, world.size
GAS, ROWS, SEQ = 2, 12, 8


def build(kind, stage):
    model = make_model("odd")
    if kind in TORCH:
        cfg = {"stage": stage, "gradient_accumulation_steps": GAS, "gradient_clipping": 1.0, "bucket_size": 300}
        return zerompi.initialize(model, cfg, optimizer=lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.01),
                                  lr_scheduler=TORCH[kind])[0]  # DeepSpeed's arguments: DeepSpeed's 4-tuple
    ds = {"train_micro_batch_size_per_gpu": ROWS // GAS // N, "gradient_accumulation_steps": GAS,
          "gradient_clipping": 1.0, "zero_optimization": {"stage": stage, "reduce_bucket_size": 300},
          "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
          "scheduler": {"type": kind, "params": DS[kind]}}
    return zerompi.initialize(model, ds)


def train(engine, first, count, lrs):
    vocab = vocab_of(engine.module)
    for step in range(first, first + count):
        x, y = global_batch(step, ROWS, SEQ, vocab)
        lrs.append([g["lr"] for g in engine.param_groups])  # the lr this update uses
        for sl in micro_slices(ROWS, GAS, rank, N):
            _, loss = engine(x[sl], y[sl])
            engine.backward(loss)
            engine.step()


def formula(kind, steps):
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([p], lr=0.01, weight_decay=0.01)
    sched = TORCH[kind](opt) if kind in TORCH else ds_schedules.from_block(opt, {"type": kind, "params": DS[kind]})
    out = []
    for _ in range(steps):
        out.append([g["lr"] for g in opt.param_groups])
        opt.step()
        sched.step()
    return out


result = {}
for case in a.cases.split(","):
    kind, stage = case.split(":")
    stage = int(stage)
    r = whole_and_resumed(lambda: build(kind, stage), train, a.steps, a.split, os.path.join(a.dir, f"{kind}-{stage}"))
    if rank == 0:
        result[case] = {"whole": r["whole_record"], "resumed": r["resumed_record"], "formula": formula(kind, a.steps),
                        "param_diff": r["diff"], "sched": type(r["resumed"].lr_scheduler).__name__}
if rank == 0:
    with open(a.out, "w") as f:
        json.dump(result, f)
