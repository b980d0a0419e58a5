"""zerompi.Init on the issue-13 models: bitwise the weights of a plain build, bounded
full parameters, engines take over, and wrong uses fail naming the parameter."""
from zerompi.runtime import pause_collector; pause_collector()  # until freeze_startup_heap: runtime/pygc.py
import argparse
import json
import warnings

import torch
import torch.nn as nn
from mpi4py import MPI

import zerompi
import zoo
from common import make_model
from zerompi.zero.init_context import adopt
zerompi.runtime.freeze_startup_heap()  # as zerompi.train does (runtime/pygc.py)

warnings.filterwarnings("ignore")  # transformers' config chatter
ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("--mode", default="bitwise")
ap.add_argument("--kinds", default=",".join(zoo.KINDS + ("gpt", "llama", "odd", "shapes")))
a = ap.parse_args()
world = MPI.COMM_WORLD
rank, N = world.rank, world.size
cfg = {"stage": 3, "bucket_size": 256, "seed": 5}
KEEP = 4  # full parameters Init may hold at once


def build(kind):
    return zoo.build(kind) if kind in zoo.KINDS else make_model(kind, seed=5)


def plain(kind):
    torch.manual_seed(5)
    m = build(kind)
    return m, torch.get_rng_state()


def under_init(kind, **kw):
    with zerompi.Init(cfg, keep_full=KEEP, **kw) as ini:
        m = build(kind)
    return m, torch.get_rng_state(), ini.stats()


def error_of(fn) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the message is what is tested
        return f"{type(e).__name__}: {e}"
    return ""


def under_init_lazy():
    with zerompi.Init(cfg):
        nn.LazyLinear(4)


res = {}
if a.mode == "bitwise":
    for kind in a.kinds.split(","):
        ref, ref_rng = plain(kind)
        model, rng, stats = under_init(kind)
        params = list(model.named_parameters())
        full_bytes = sum(p.untyped_storage().nbytes() for _, p in params)
        pieces = sum(p._zero_init.piece.numel() for _, p in params)
        psi = sum(p.numel() for _, p in params)
        # half the values through GatheredParameters, the rest through adopt (the stores' way)
        half = len(params) // 2
        got = {}
        with zerompi.GatheredParameters([p for _, p in params[:half]]):
            got.update({n: p.detach().clone() for n, p in params[:half]})
        still_partitioned = all(p.untyped_storage().nbytes() == 0 for _, p in params[:half])
        got.update({n: adopt(p) for n, p in params[half:]})
        diff = [n for n, p in ref.named_parameters() if not torch.equal(got[n].float(), p.detach().float())]
        res[kind] = {"diff": diff, "same_rng": torch.equal(rng, ref_rng), "full_bytes": full_bytes,
                     "pieces": pieces, "psi": psi, "nparams": len(params), "still": still_partitioned,
                     "largest": sum(sorted(p.numel() for _, p in params)[-KEEP:]),
                     "plain_after_adopt": all(type(p) is nn.Parameter and not hasattr(p, "_zero_init")
                                              for _, p in params[half:]), **stats}
    # load_state_dict inside Init (different seed first), and engines taking the model over
    # (odd: a frozen parameter, which the engine replicates through adopt too)
    for kind in ("gpt", "hf-gpt2", "odd"):
        ref, _ = plain(kind)
        sd = {k: v.clone() for k, v in ref.state_dict().items()}
        with zerompi.Init(cfg, seed=6, keep_full=KEEP):
            model = build(kind)
            model.load_state_dict(sd)
        with zerompi.GatheredParameters(model):
            loaded = all(torch.equal(p, ref.get_parameter(n)) for n, p in model.named_parameters())
        res[f"load-{kind}"] = loaded
        for stage in (1, 3):
            model, _, _ = under_init(kind)
            eng = zerompi.initialize(model, {**cfg, "stage": stage})
            sd = eng.full_state_dict(all_ranks=True)
            res[f"engine{stage}-{kind}"] = [n for n, p in ref.named_parameters()
                                            if not torch.equal(sd[n], p.detach())]
elif a.mode == "errors":
    model, _, _ = under_init("tenc")
    w = model.enc.layers[1].self_attn.out_proj.weight
    res["inplace"] = error_of(lambda: w.normal_())
    res["forward"] = error_of(lambda: model(torch.zeros(1, 4, dtype=torch.long)))
    res["state_dict"] = error_of(lambda: model.state_dict())
    res["repr"] = repr(w)
    res["meta_ok"] = [tuple(w.shape), w.numel(), str(w.dtype), w.requires_grad, w.dim()]
    model.cpu()  # conversions that change nothing need no values
    res["cpu_ok"] = True
    res["lazy"] = error_of(lambda: under_init_lazy())
    # ranks touching parameters differently: caught at exit, named
    def diverge():
        with zerompi.Init(cfg, keep_full=KEEP):
            m = zoo.build("flinear")
            if rank == 1:
                with torch.no_grad():
                    m.blocks[0].child.bias.fill_(1.0)
    res["diverge"] = error_of(diverge)
    # GatheredParameters(modifier_rank=0), inside and after the block: rank 0's edit everywhere
    with zerompi.Init(cfg, keep_full=1):
        m = zoo.build("flinear")
        w_in = m.blocks[0].child.weight
        with zerompi.GatheredParameters([w_in], modifier_rank=0):
            if rank == 0:
                w_in.data.fill_(0.5)
    w_out = m.blocks[1].child.weight
    with zerompi.GatheredParameters([w_out], modifier_rank=0):
        if rank == 0:
            w_out.data[0].fill_(0.25)
    # one op on several partitioned parameters with keep_full=1: bringing in the second
    # must not partition the first under the op
    ref, _ = plain("flinear")
    with zerompi.Init(cfg, keep_full=1):
        m = zoo.build("flinear")
        both = torch.cat([m.blocks[0].child.weight, m.blocks[1].child.weight, m.emb.weight])
    with zerompi.Init(cfg, keep_full=KEEP):  # a nested block is part of the outer one
        with zerompi.Init(cfg):
            nested = zoo.build("flinear")
        nested_full = nested.emb.weight.sum()  # still inside the outer block: gathers
    res["nested_ok"] = bool(torch.equal(nested_full, ref.emb.weight.sum()))
    res["cat_ok"] = torch.equal(both, torch.cat([ref.blocks[0].child.weight, ref.blocks[1].child.weight,
                                                 ref.emb.weight]))
    res["modified"] = [bool((adopt(w_in) == 0.5).all()), bool((adopt(w_out)[0] == 0.25).all())]
elif a.mode == "stuck":
    # rank 0 alone reads a partitioned parameter: its gather must fail, named, not hang
    with zerompi.Init(cfg, keep_full=1, timeout=3):
        m = zoo.build("flinear")
        if rank == 0:
            m.blocks[0].child.weight.sum()


if rank == 0:
    json.dump(res, open(a.out, "w"))
