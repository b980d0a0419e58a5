"""Tensor parallelism for the reference GPT (issue 15) in one process: at tp = 1 the
parallel model is bitwise the plain one, the vocab-parallel cross-entropy's value and
gradient, padding, and the errors. On 1-4 ranks: tests/multirank/test_tp_model.py."""
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

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
