"""The reference GPT split by parallel/parallelize.py against the plain GPT built with the
same seed, on every rank: local weights are the tp_layout slices of the plain weights
(bitwise), loss and gradients match, the padded vocabulary never matters, a few AdamW
SGD steps follow the plain run. Rank 0 writes the JSON; each rank's own numbers are
gathered into it (a failed comparison is reported, not asserted, so the test names it).
"""
import argparse
import json

import torch

from zerompi.models.gpt import GPT, PRESETS, GPTConfig
from zerompi.parallel.parallelize import parallelize
from zerompi.parallel import tp_layout
from zerompi.parallel.dims import ParallelDims

torch.set_num_threads(1)
ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("--tp", type=int, default=2)
ap.add_argument("--model", default="tiny")  # tiny | odd (vocab 300, 4 heads, no bias)
a = ap.parse_args()

dims = ParallelDims.create(tp_size=a.tp)
tp = dims.tp
cfg = PRESETS["tiny"] if a.model == "tiny" else GPTConfig(
    vocab_size=300, block_size=32, n_layer=2, n_head=4, n_embd=64, bias=False)
SEED, B, T, STEPS = 7, 4, 16, 3


def build():
    torch.manual_seed(SEED)
    return GPT(cfg)


def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
    return x, torch.roll(x, -1, 1)


def rel(a_, b_):
    return float((a_.double() - b_.double()).abs().max() / max(b_.double().abs().max(), 1e-30))


plain, par = build(), parallelize(build(), tp)
full = dict(plain.named_parameters())
res = {"tp": tp.size, "tp_rank": tp.rank, "rank": dims.rank, "weights_differ": [], "split": {},
       "grad_rel": {}, "unmarked": []}

# (a) tp-invariant initialisation: every local weight is its slice of the full weight
for n, p in par.named_parameters():
    s = tp_layout.split_of(p)
    res["split"][n] = None if s is None else [s.dim, list(s.full_shape), s.start, s.groups]
    if s is None:
        res["unmarked"].append(n)
    if tuple(tp_layout.full_shape(p)) != tuple(full[n].shape) or \
            not torch.equal(p.detach(), tp_layout.local_index(p, full[n].detach())):
        res["weights_differ"].append(n)
res["tied"] = par.lm_head.weight is par.wte.weight
res["nparams_same_set"] = sorted(dict(par.named_parameters())) == sorted(full)

# (b) loss, (c) gradients, logits
x, y = batch(0)
logits_p, loss_p = plain(x, y)
loss_p.backward()
logits_t, loss_t = par(x, y)
loss_t.backward()
res["loss_plain"], res["loss_tp"] = loss_p.item(), loss_t.item()
res["loss_bitwise"] = bool(torch.equal(loss_p, loss_t))
res["logits_width"] = logits_t.shape[-1]
gathered = torch.empty(tp.size * logits_t.numel())
tp.all_gather(logits_t.detach().contiguous().view(-1), gathered)
whole = gathered.view(tp.size, B, T, -1).permute(1, 2, 0, 3).reshape(B, T, -1)
res["logits_rel"] = rel(whole[..., :cfg.vocab_size], logits_p.detach())
res["padded_logits_zero"] = bool((whole[..., cfg.vocab_size:] == 0).all())
for n, p in par.named_parameters():
    ref = tp_layout.local_index(p, full[n].grad)
    res["grad_rel"][n] = rel(p.grad, ref)
    res.setdefault("grads_bitwise", True)
    res["grads_bitwise"] &= bool(torch.equal(p.grad, ref))
wte = par.wte
res["pad_rows"] = wte.local_vocab - wte.real_rows
res["pad_grad_zero"] = bool((wte.weight.grad[wte.real_rows:] == 0).all())
res["wte_grad_bitwise"] = bool(torch.equal(wte.weight.grad,
                                           tp_layout.local_index(wte.weight, full["wte.weight"].grad)))

# replicated parameters: the same gradient on every tp rank (bitwise)
rep = {n: p.grad.clone() for n, p in par.named_parameters() if tp_layout.split_of(p) is None}
res["replicated_grads_agree"] = all(
    all(torch.equal(o[n], rep[n]) for n in rep) for o in tp.allgather_object(rep))
res["loss_agrees"] = len(set(tp.allgather_object(loss_t.item()))) == 1

# (d) padded logits never matter: garbage in the padding rows changes nothing
grads_before = {n: p.grad.clone() for n, p in par.named_parameters()}
par.zero_grad()
with torch.no_grad():
    wte.weight[wte.real_rows:].normal_(0.0, 5.0)
_, loss_g = par(x, y)
loss_g.backward()
res["garbage_loss_bitwise"] = bool(torch.equal(loss_g, loss_t))
res["garbage_pad_grad_zero"] = bool((wte.weight.grad[wte.real_rows:] == 0).all())
res["garbage_grads_bitwise"] = all(torch.equal(p.grad, grads_before[n]) for n, p in par.named_parameters())
with torch.no_grad():
    wte.weight[wte.real_rows:].zero_()

# a few SGD steps (weight decay on: padding rows must stay zero): local updates are
# slices of the full update (SGD, not Adam, whose normalisation blows up rounding noise)
plain.zero_grad()
par.zero_grad()
opt_p = torch.optim.SGD(plain.parameters(), lr=0.5, momentum=0.9, weight_decay=0.1, foreach=False)
opt_t = torch.optim.SGD(par.parameters(), lr=0.5, momentum=0.9, weight_decay=0.1, foreach=False)
res["train_plain"], res["train_tp"] = [], []
for step in range(STEPS):
    x, y = batch(step + 1)
    for m, o, key in ((plain, opt_p, "train_plain"), (par, opt_t, "train_tp")):
        o.zero_grad()
        _, loss = m(x, y)
        loss.backward()
        o.step()
        res[key].append(loss.item())
res["pad_rows_after_training_zero"] = bool((wte.weight[wte.real_rows:] == 0).all())
res["weights_rel_after_training"] = max(
    rel(p.detach(), tp_layout.local_index(p, full[n].detach())) for n, p in par.named_parameters())

everyone = dims.world.allgather_object(res)
if dims.rank == 0:
    json.dump({"ranks": everyone}, open(a.out, "w"))
