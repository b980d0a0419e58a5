"""Tensor parallelism for the reference GPT (issue 15): parallel/tensor_parallel.py's
layers and parallel/parallelize.py against the plain GPT built with the same seed.

tests/workers/tp_model.py: at tp = 2 and 4 every local weight is its tp_layout slice of
the plain weight (bitwise), the loss and every local gradient match the plain model's,
replicated gradients agree across tp ranks, the padded vocabulary gets no gradient and
garbage in it changes nothing, and SGD steps follow the plain run; at tp = 1 all of it is
bitwise. In-process: the vocab-parallel cross-entropy's gradient, and the errors.
"""
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from mpirun import run_worker
from zerompi.models.gpt import GPT, PRESETS, GPTConfig
from zerompi.parallel.parallelize import parallelize
from zerompi.parallel import tp_layout
from zerompi.parallel.tensor_parallel import padded_vocab_size, vocab_parallel_cross_entropy

ODD = GPTConfig(vocab_size=300, block_size=32, n_layer=2, n_head=4, n_embd=64, bias=False)


class SoloTP:
    """A tp group of one (the layers never communicate at tp = 1)."""
    size, rank = 1, 0

    def all_reduce(self, t, op="sum", async_op=False, scratch=None):
        return None


def _check_rank(d, model, tp):
    vocab = 256 if model == "tiny" else 300
    assert d["weights_differ"] == [], d["weights_differ"]          # (a) tp-invariant init
    assert d["tied"] and d["nparams_same_set"]
    assert d["replicated_grads_agree"] and d["loss_agrees"]
    # (b) loss
    assert abs(d["loss_tp"] - d["loss_plain"]) <= 1e-6 * abs(d["loss_plain"]), d
    assert d["logits_rel"] <= 1e-6
    # (c) gradients: every local gradient is the slice of the plain gradient
    worst = max(d["grad_rel"], key=d["grad_rel"].get)
    assert d["grad_rel"][worst] <= 1e-5, (worst, d["grad_rel"][worst])
    # (d) padding: no gradient, garbage in it changes nothing, stays zero while training
    assert d["pad_grad_zero"] and d["padded_logits_zero"]
    assert d["garbage_loss_bitwise"] and d["garbage_pad_grad_zero"] and d["garbage_grads_bitwise"]
    assert d["pad_rows_after_training_zero"]
    assert d["train_tp"] == pytest.approx(d["train_plain"], rel=1e-5)
    assert d["weights_rel_after_training"] <= 1e-5
    padded = padded_vocab_size(vocab, tp)
    assert d["logits_width"] == (vocab if tp == 1 else padded // tp)
    pad_here = max(0, min(padded // tp, (d["tp_rank"] + 1) * padded // tp - vocab))
    assert d["pad_rows"] == pad_here
    # what is split, and how (tp_layout's contract); replicated parameters are unmarked
    s, t, c = d["split"], d["tp_rank"], 64
    assert s["wte.weight"] == [0, [vocab, c], t * padded // tp, 1]
    assert s["h.0.attn.c_attn.weight"] == [0, [3 * c, c], t * c // tp, 3]
    assert s["h.1.attn.c_proj.weight"] == [1, [c, c], t * c // tp, 1]
    assert s["h.0.mlp.c_fc.weight"] == [0, [4 * c, c], t * 4 * c // tp, 1]
    assert s["h.0.mlp.c_proj.weight"] == [1, [c, 4 * c], t * 4 * c // tp, 1]
    if model == "tiny":
        assert s["h.0.attn.c_attn.bias"] == [0, [3 * c], t * c // tp, 3]
        assert s["h.0.mlp.c_fc.bias"] == [0, [4 * c], t * 4 * c // tp, 1]
        assert s["h.0.mlp.c_proj.bias"] is None and s["h.0.attn.c_proj.bias"] is None
    for name in ("wpe.weight", "ln_f.weight", "h.0.ln_1.weight", "h.1.ln_2.weight"):
        assert s[name] is None, name
    if tp == 1:  # bitwise the plain model
        assert d["loss_bitwise"] and d["grads_bitwise"] and d["wte_grad_bitwise"]
        assert d["train_tp"] == d["train_plain"] and d["weights_rel_after_training"] == 0


@pytest.mark.parametrize("n,model", [(1, "tiny"), (1, "odd"), (2, "tiny"), (2, "odd"), (4, "odd")])
def test_parallel_gpt_equals_the_plain_gpt(tmp_path, n, model):
    res = run_worker(n, "tp_model", ["--tp", str(n), "--model", model], tmp_path, timeout=240)
    ranks = res["ranks"]
    assert [d["tp_rank"] for d in ranks] == list(range(n))
    for d in ranks:
        _check_rank(d, model, n)
    assert len({d["loss_tp"] for d in ranks}) == 1


@pytest.mark.parametrize("cfg", [PRESETS["tiny"], ODD])
def test_tp1_in_process_is_bitwise_the_plain_model(cfg):
    torch.manual_seed(3)
    plain = GPT(cfg)
    torch.manual_seed(3)
    par = GPT(cfg)
    rng = torch.get_rng_state()
    parallelize(par, SoloTP())
    assert torch.equal(torch.get_rng_state(), rng)  # no random numbers drawn
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (2, 16), generator=g)
    y = torch.roll(x, -1, 1)
    lp, loss_p = plain(x, y)
    lt, loss_t = par(x, y)
    assert torch.equal(lp, lt) and torch.equal(loss_p, loss_t)
    loss_p.backward()
    loss_t.backward()
    full = dict(plain.named_parameters())
    for n, p in par.named_parameters():
        assert torch.equal(p.grad, tp_layout.local_index(p, full[n].grad)), n


def test_vocab_parallel_cross_entropy_value_and_gradient():
    """The custom autograd function at one rank: F.cross_entropy's value over the real
    columns, padding columns ignored (-inf) and given no gradient; gradcheck in fp64."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 5, 12, generator=g, dtype=torch.float64) * 3
    targets = torch.randint(0, 9, (3, 5), generator=g)
    targets[0, 0] = -100  # ignored
    logits.requires_grad_(True)
    loss = vocab_parallel_cross_entropy(logits, targets, SoloTP(), vocab_size=9, vocab_start=0)
    ref = F.cross_entropy(logits[..., :9].reshape(-1, 9), targets.reshape(-1))
    assert torch.allclose(loss, ref, rtol=1e-12)
    loss.backward()
    assert (logits.grad[..., 9:] == 0).all()
    z = logits.detach().requires_grad_()
    assert torch.autograd.gradcheck(lambda z: vocab_parallel_cross_entropy(z, targets, SoloTP(), 9, 0), (z,))
    # fp32 logits of a bf16 model: computed in fp32
    lo = logits.detach().to(torch.bfloat16)
    assert vocab_parallel_cross_entropy(lo, targets, SoloTP(), 9, 0).dtype == torch.float32


def test_padded_vocab_size():
    assert padded_vocab_size(256, 1) == 256 and padded_vocab_size(256, 2) == 256
    assert padded_vocab_size(300, 1) == 384 and padded_vocab_size(300, 2) == 512
    assert padded_vocab_size(50257, 8) == 51200


@pytest.mark.parametrize("cfg,tp,field", [
    (PRESETS["tiny"], 4, "n_head"),                                  # 2 heads over 4 ranks
    (GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=3, n_embd=6), 2, "n_head"),
    (GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=8, dropout=0.1), 2, "dropout"),
])
def test_parallelize_refuses_what_it_cannot_split(cfg, tp, field):
    with pytest.raises(ValueError, match=rf"tensor_parallel_size' = {tp}.*{field}"):
        parallelize(GPT(cfg), SimpleNamespace(size=tp, rank=0))


def test_plain_gpt_unchanged_and_parallelize_only_once():
    m = GPT(PRESETS["tiny"])
    assert m.loss_fn.__name__ == "cross_entropy_fp32"
    parallelize(m, SoloTP())
    with pytest.raises(ValueError, match="already tensor parallel"):
        parallelize(m, SoloTP())
