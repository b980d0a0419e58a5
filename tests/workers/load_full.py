"""engine.load_full_state_dict: a transformers GPT-2 saved with save_pretrained, loaded
on rank 0 with from_pretrained, streamed into engines built (under zerompi.Init) with
other weights; key errors are raised on every rank, naming the key."""
import argparse
import json
import warnings

import torch
import transformers as tf
from mpi4py import MPI

import zerompi

warnings.filterwarnings("ignore")
tf.logging.set_verbosity_error()
ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("--dir", required=True)
a = ap.parse_args()
world = MPI.COMM_WORLD
rank = world.rank
cfg = tf.GPT2Config(vocab_size=37, n_positions=32, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                    embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
                    attn_implementation="eager")
if rank == 0:
    torch.manual_seed(1)
    tf.GPT2LMHeadModel(cfg).save_pretrained(a.dir)
world.Barrier()
pre = tf.GPT2LMHeadModel.from_pretrained(a.dir) if rank == 0 else None
sd = pre.state_dict() if rank == 0 else None
x = torch.randint(0, 37, (2, 12), generator=torch.Generator().manual_seed(3))
res = {}


def engine(stage, precision):
    with zerompi.Init({"stage": stage, "seed": 2}):
        model = tf.GPT2LMHeadModel(cfg)  # other weights than the pretrained ones
    return zerompi.initialize(model, {"stage": stage, "precision": precision, "bucket_size": 256})


for stage, precision in ((3, "fp32"), (1, "bf16"), (3, "bf16")):
    eng = engine(stage, precision)
    out = eng.load_full_state_dict(sd)
    full = eng.full_state_dict()
    with torch.no_grad():
        logits = eng(input_ids=x).logits.float()
    if rank == 0:
        with torch.no_grad():
            want = pre(input_ids=x).logits
        res[f"{stage}-{precision}"] = {
            "result": [out.missing_keys, out.unexpected_keys],
            "same": sorted(k for k in full if torch.equal(full[k], sd[k])) == sorted(full),
            "n": len(full), "logits_err": float((logits - want).abs().max())}


def error_of(mutate, strict=True) -> str:
    eng = engine(3, "fp32")
    bad = None
    if rank == 0:
        bad = dict(sd)
        mutate(bad)
    try:
        eng.load_full_state_dict(bad, strict=strict)
    except ValueError as e:
        return str(e)
    return ""


errors = {
    "missing": error_of(lambda d: d.pop("transformer.h.1.mlp.c_fc.bias")),
    "unexpected": error_of(lambda d: d.__setitem__("transformer.extra.weight", torch.zeros(3))),
    "shape": error_of(lambda d: d.__setitem__("transformer.wpe.weight", torch.zeros(31, 32))),
    # tied: the head's key alone is enough (HF checkpoints often carry one name only)
    "tied_one_name": error_of(lambda d: d.pop("transformer.wte.weight")),
}
# from_pretrained itself under Init (every rank reads the files): partitioned, same weights
with zerompi.Init({"stage": 3}):
    built = tf.GPT2LMHeadModel.from_pretrained(a.dir)
with zerompi.GatheredParameters(built):
    mine = {k: v.clone() for k, v in built.state_dict().items()}
res["init_from_pretrained"] = {
    "partitioned": all(p.untyped_storage().nbytes() == 0 for p in built.parameters()),
    "same": world.bcast(sd if rank == 0 else None).keys() == mine.keys()
    and all(torch.equal(mine[k], v) for k, v in world.bcast(sd if rank == 0 else None).items())}
eng = engine(3, "fp32")
partial = eng.load_full_state_dict({k: v for k, v in sd.items() if ".h.1." not in k} if rank == 0
                                   else None, strict=False)
res["errors_everywhere"] = world.allgather(errors)
res["partial_missing"] = partial.missing_keys
if rank == 0:
    json.dump(res, open(a.out, "w"))
