"""Stage 3's gather pool (zero/stage3/gather_pool.py) on a 4-block reference GPT: which memory
each unit is gathered into, step after step, against the same training without the pool;
and the fallback when more units are gathered at once than the pool holds."""
import argparse
import json

import torch
from mpi4py import MPI

import zerompi
from common import global_batch, micro_slices
from zerompi.models.gpt import GPT, GPTConfig
from zerompi.zero.stage3 import gather_pool

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("--steps", type=int, default=4)
a = ap.parse_args()
world = MPI.COMM_WORLD
rank, N = world.rank, world.size
shape = GPTConfig(vocab_size=64, block_size=32, n_layer=4, n_head=2, n_embd=32)
cfg = {"stage": 3, "bucket_size": 2048, "seed": 3}


def train(pooled: bool) -> dict:
    real = gather_pool.available
    if not pooled:  # what torch without storage swaps gets: units resize their own storage
        gather_pool.available = lambda: False
    try:
        torch.manual_seed(3)
        model = GPT(shape)
        eng = zerompi.initialize(model, cfg)
    finally:
        gather_pool.available = real
    store = eng.param_store
    seen: list[dict] = []  # per step: unit -> data pointers its storage had when its root ran

    def record(u):
        def hook(mod, args):
            seen[-1].setdefault(u.name, set()).add(u.full.untyped_storage().data_ptr())
        return hook

    for u in store.units:  # registered after the engine's hooks: runs once the unit is gathered
        for root in u.roots:
            root.register_forward_pre_hook(record(u))
    slots0 = sorted(s.storage.data_ptr() for s in store.pool.free) if store.pool else []
    losses = []
    for step in range(a.steps):
        seen.append({})
        x, y = global_batch(step, 4 * N, 16, shape.vocab_size)
        sl = micro_slices(4 * N, 1, rank, N)[0]
        _, loss = eng(x[sl], y[sl])
        eng.backward(loss)
        eng.step()
        losses.append(float(loss.detach()))
    out = {"losses": losses, "report": eng.memory_report(), "materialized": eng.materialized_params(),
           "units": [u.name for u in store.units], "unit_sizes": [u.size for u in store.units],
           "params": {n: p.tolist() for n, p in eng.full_state_dict(all_ranks=True).items()}}
    # a released parameter cannot be read (its storage is back to 0 bytes): what torch says
    errors = []
    # (elementwise reads such as w.sum() crash torch on such a storage, with or without the pool)
    for read in (lambda w: torch.mv(w, torch.ones(shape.n_embd)),
                 lambda w: torch.nn.functional.linear(torch.ones(2, shape.n_embd), w)):
        try:
            read(model.h[0].mlp.c_fc.weight)
            errors.append(None)
        except RuntimeError as e:
            errors.append(str(e).splitlines()[0])
    out["released_read_errors"] = errors
    if store.pool is not None:
        pool = store.pool
        out["slots"] = sorted(s.numel for s in pool.free)
        out["slots_same_memory"] = sorted(s.storage.data_ptr() for s in pool.free) == slots0
        out["pointers_in_pool"] = all(p in slots0 for st in seen for ps in st.values() for p in ps)
        out["pointers_per_step"] = [sorted({p for ps in st.values() for p in ps}) for st in seen]
        out["fallbacks_training"] = pool.fallbacks
        # every unit at once: more than the pool holds -> fresh buffers, counted, no hang
        full = eng.full_state_dict(all_ranks=True)
        params = list(model.parameters())
        with zerompi.GatheredParameters(params, engine=eng):
            inside = all(torch.equal(p.detach(), full[n]) for n, p in model.named_parameters())
            out["gathered_inside"] = eng.memory_report()["gathered"]
        out["gather_all_ok"] = inside
        out["fallbacks_gather_all"] = pool.fallbacks - out["fallbacks_training"]
        out["after_gather_all"] = {"gathered": eng.memory_report()["gathered"],
                                   "fallback_bytes": pool.fallback_bytes,
                                   "slots_same_memory": sorted(s.storage.data_ptr() for s in pool.free) == slots0,
                                   "materialized": eng.materialized_params()}
        before = pool.fallbacks
        x, y = global_batch(99, 4 * N, 16, shape.vocab_size)
        sl = micro_slices(4 * N, 1, rank, N)[0]
        _, loss = eng(x[sl], y[sl])
        eng.backward(loss)
        eng.step()
        out["fallbacks_after"] = pool.fallbacks - before
    return out


res = {"pool": train(True), "no_pool": train(False)}
if rank == 0:
    json.dump(res, open(a.out, "w"))
