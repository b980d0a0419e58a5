"""A checkpoint written by an older zerompi must keep loading.

  make --dir D   (run once, with the old code on PYTHONPATH): train the `odd` model
                 2 steps, save D/ckpt, and D/reference.npz = full_state_dict()
  load --dir D --stage S --out F: build the same model at this world size and stage,
                 load D/ckpt, and report whether every fp32 value equals reference.npz
                 bitwise, then run one more step to show training continues.
"""
import argparse
import json
import os

import numpy as np
import torch

import zerompi
from common import global_batch, make_model, vocab_of

ap = argparse.ArgumentParser()
ap.add_argument("mode", choices=["make", "load"])
ap.add_argument("--dir", required=True)
ap.add_argument("--stage", type=int, default=2)
ap.add_argument("--out")
a = ap.parse_args()


def config(stage):
    return {"stage": stage, "precision": "bf16", "bucket_size": 256,
            "optimizer": {"lr": 1e-2, "weight_decay": 0.1}, "gradient_clipping": 1.0}


def one_step(engine, model, step):
    rank, world = engine.comm.rank, engine.comm.size
    x, y = global_batch(step, 12, 8, vocab_of(model))
    per = 12 // world
    sl = slice(rank * per, (rank + 1) * per)
    _, loss = engine(x[sl], y[sl])
    engine.backward(loss)
    engine.step()


model = make_model("odd")
if a.mode == "make":
    engine = zerompi.initialize(model, config(2))
    for step in range(2):
        one_step(engine, model, step)
    engine.save_checkpoint(os.path.join(a.dir, "ckpt"), tag="step-2", client_state={"made_by": zerompi.__file__})
    sd = engine.full_state_dict()
    if engine.comm.rank == 0:
        np.savez(os.path.join(a.dir, "reference.npz"), **{k: v.numpy() for k, v in sd.items()})
else:
    engine = zerompi.initialize(model, config(a.stage))
    client = engine.load_checkpoint(os.path.join(a.dir, "ckpt"))
    sd = engine.full_state_dict()
    ref = np.load(os.path.join(a.dir, "reference.npz"))
    out = {"client": client, "global_steps": engine.global_steps}
    if engine.comm.rank == 0:
        out["names_equal"] = sorted(ref.files) == sorted(sd)
        out["bitwise"] = {k: bool(np.array_equal(ref[k], sd[k].numpy())) for k in ref.files if k in sd}
    one_step(engine, model, 2)
    out["finite_after_step"] = all(bool(torch.isfinite(v).all()) for v in engine.full_state_dict(all_ranks=True).values())
    if engine.comm.rank == 0:
        with open(a.out, "w") as f:
            json.dump(out, f)
