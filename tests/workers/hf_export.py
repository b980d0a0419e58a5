"""Train a transformers GPT-2 (tied head) 2 steps under zerompi, save a checkpoint, and
write the engine's full_state_dict for comparison: --dir CKPT --out RESULT.json."""
from zerompi.runtime import pause_collector; pause_collector()  # until freeze_startup_heap: runtime/pygc.py
import argparse
import json

import torch
import transformers as tf

import zerompi
zerompi.runtime.freeze_startup_heap()  # as zerompi.train does (runtime/pygc.py)

ap = argparse.ArgumentParser()
ap.add_argument("--dir")
ap.add_argument("--out")
a = ap.parse_args()
torch.manual_seed(0)
cfg = tf.GPT2Config(vocab_size=37, n_positions=16, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
                    eos_token_id=0)
model = tf.GPT2LMHeadModel(cfg)
engine = zerompi.initialize(model, {"stage": 2, "optimizer": {"lr": 1e-2}})
for step in range(2):
    x = torch.randint(0, 37, (4, 16), generator=torch.Generator().manual_seed(step))
    engine.backward(engine(input_ids=x, labels=x).loss)
    engine.step()
engine.save_checkpoint(a.dir)
full = engine.full_state_dict()
if engine.comm.rank == 0:
    torch.save(full, a.dir + "/full.pt")
    json.dump({"ok": True, "config": cfg.to_dict()}, open(a.out, "w"))
