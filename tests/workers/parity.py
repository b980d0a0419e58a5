"""Parity worker: stages x (one precision) against single-process torch AdamW.

Writes (rank 0) per stage: max |param - reference|, per-step losses and gradient norms,
the max relative error of the first step's reduced gradient, plus the noise floor (the
reference computed in another summation order)."""
from zerompi.runtime import pause_collector; pause_collector()  # until freeze_startup_heap: runtime/pygc.py
import argparse
import json

import torch
from mpi4py import MPI

import zerompi
from zerompi.optim import decay_groups
from common import global_batch, make_model, micro_slices, reference_run, vocab_of
zerompi.runtime.freeze_startup_heap()  # as zerompi.train does (runtime/pygc.py)

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("--stages", default="0,1,2,3")
ap.add_argument("--precision", default="fp32")
ap.add_argument("--model", default="odd")
ap.add_argument("--steps", type=int, default=10)
ap.add_argument("--gas", type=int, default=2)
ap.add_argument("--rows", type=int, default=24)
ap.add_argument("--seq", type=int, default=16)
ap.add_argument("--lr", type=float, default=1e-3)
ap.add_argument("--clip", type=float, default=1.0)
ap.add_argument("--bucket", type=lambda v: v if v == "auto" else int(v), default=300)
ap.add_argument("--groups", action="store_true", help="decay matrices only (two param groups)")
ap.add_argument("--persist", type=int, default=0, help="stage3.persistence_threshold")
ap.add_argument("--unit-classes", default="auto", help="stage3.unit_classes")
ap.add_argument("--unit-min", type=int, default=0, help="stage3.unit_min_elements")
ap.add_argument("--coalesce", type=lambda v: v if v == "auto" else int(v), default="auto",
                help="stage3.coalesce_elements")
ap.add_argument("--init", default="0", help="0: plain build, 1: under zerompi.Init, 0,1: both "
                "(stage 3 only; results 'stageS' and 'stageS_init')")
ap.add_argument("--device", default="cpu", help="cpu | cuda (every rank on cuda:0 unless "
                "there are as many GPUs as ranks)")
ap.add_argument("--backend", default="auto", help="comm.backend")
ap.add_argument("--offload", default="none", help="offload_optimizer")
ap.add_argument("--impl", default="auto", help="optimizer.implementation")
ap.add_argument("--offload-cfg", default="{}", help="the offload section, as JSON")
a = ap.parse_args()

world = MPI.COMM_WORLD
rank, N = world.rank, world.size
result = {"world": N}
dev = torch.device("cpu")
if a.device == "cuda":
    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
if rank == 0:  # the reference runs where the engine runs (same kernels, one process)
    ref = make_model(a.model).to(dev)
    losses, norms, grads0 = reference_run(ref, a.steps, a.rows, a.seq, a.lr, a.clip, groups=a.groups,
                                          device=dev)
    floor_model = make_model(a.model).to(dev)
    _, _, _ = reference_run(floor_model, a.steps, a.rows, a.seq, a.lr, a.clip, micro=a.gas * N,
                            groups=a.groups, device=dev)
    refp = dict(ref.named_parameters())
    result["ref_losses"], result["ref_norms"] = losses, norms
    result["floor"] = max((p - refp[n]).abs().max().item() for n, p in floor_model.named_parameters())

runs = [(int(s), init == "1") for s in a.stages.split(",")
        for init in (a.init.split(",") if s == "3" else ["0"])]
for stage, init in runs:
    key = f"stage{stage}" + ("_init" if init else "")
    cfg = {"stage": stage, "precision": a.precision, "gradient_accumulation_steps": a.gas,
           "gradient_clipping": a.clip, "bucket_size": a.bucket,
           "stage3": {"persistence_threshold": a.persist, "unit_classes": a.unit_classes,
                      "unit_min_elements": a.unit_min, "coalesce_elements": a.coalesce},
           "optimizer": {"lr": a.lr, "weight_decay": 0.01, "implementation": a.impl}, "comm": {"backend": a.backend},
           "offload_optimizer": a.offload, "offload": json.loads(a.offload_cfg)}
    if init:
        with zerompi.Init(cfg, seed=0):  # make_model seeds 0 as well
            model = make_model(a.model)
    else:
        model = make_model(a.model)
    model.to(dev)
    engine = zerompi.initialize(model, cfg, param_groups=decay_groups(model, 0.1) if a.groups else None)
    losses, norms, grad_err = [], [], None
    for step in range(a.steps):
        x, y = global_batch(step, a.rows, a.seq, vocab_of(model), dev)
        tot = 0.0
        for sl in micro_slices(a.rows, a.gas, rank, N):
            _, loss = engine(x[sl], y[sl])
            engine.backward(loss)
            tot += loss.item()
            if step == 0 and engine.micro_steps == a.gas - 1:
                full = engine.full_grads()
                if rank == 0:
                    # Relative per parameter, but a gradient that is zero in exact maths
                    # (BERT's key bias: softmax ignores a per-query constant) is rounding
                    # noise (~1e-13): measure it against 1e-6 of the whole gradient's norm.
                    total = sum(g.norm() ** 2 for g in grads0.values()) ** 0.5
                    grad_err = max(((full[n] - g).norm() / g.norm().clamp_min(1e-6 * total)).item()
                                   for n, g in grads0.items())
            engine.step()
        if stage == 3:
            # nothing stays materialised after a step; eval under no_grad gathers and
            # releases again without creating gradients or changing anything
            left = engine.materialized_params()
            with torch.no_grad():
                engine(x[:2])
            left += engine.materialized_params()
            assert engine.memory_report()["gathered"] == 0
            assert not left, f"materialised after step {step}: {left}"
            # no gradient outside the state's buffers (alone, .grad are views of them)
            assert engine.reducer.loose_grad_bytes() == 0
            assert engine.reducer.local or all(p.grad is None for p in engine.params)
        losses.append(world.allreduce(tot, op=MPI.SUM) / (N * a.gas))
        norms.append(engine.last_grad_norm)
    sd = engine.full_state_dict()
    if rank == 0:
        refp = dict(ref.named_parameters())
        assert sd.keys() == dict(ref.named_parameters()).keys(), (sd.keys(), refp.keys())
        result[key] = {
            "max_diff": max((sd[n] - p.detach()).abs().max().item() for n, p in refp.items()),
            "losses": losses, "norms": norms, "grad_rel_err": grad_err,
            "dtypes": sorted({str(p.dtype) for p in model.parameters()}),
            "devices": sorted({str(p.device) for p in model.parameters()} |
                              {str(t.device) for t in engine.state.buffers().values()}),
            "backend": type(engine.comm).__name__,
            "optimizer": type(engine.optimizer).__name__,
            "offloaded": engine.memory_report()["offloaded"],
            "master_device": str(engine.state.exp_avg.device),
        }
    if stage == 3:  # units gathered for a peer only, summed over ranks (> 0: ranks diverged)
        foreign = world.allreduce(engine.param_store.foreign, op=MPI.SUM)
        if rank == 0:
            result[key]["foreign"] = foreign
            result[key]["units"] = [u.name for u in engine.param_store.units]
if rank == 0:
    with open(a.out, "w") as f:
        json.dump(result, f)
