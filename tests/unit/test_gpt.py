import math

import pytest
import torch

from zerompi.models.gpt import GPT, GPTConfig, PRESETS, count_params

EXPECTED = {
    "tiny": 120_576,
    "small": 3_257_856,
    "gpt-20m": 19_177_472,
    "gpt-200m": 202_852_352,
    "gpt2": 124_475_904,
    "gpt-1b": 1_211_224_064,
}


def test_preset_names_and_counts():
    assert set(PRESETS) == set(EXPECTED)
    for name, n in EXPECTED.items():
        assert count_params(PRESETS[name]) == n, name


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_param_count_matches_meta_model(name):
    cfg = PRESETS[name]
    with torch.device("meta"):
        m = GPT(cfg)
    assert m.num_params() == count_params(cfg)
    assert m.num_params(non_embedding=True) == count_params(cfg, non_embedding=True)
    assert m.flops_per_token() == (
        6 * count_params(cfg, True) + 12 * cfg.n_layer * cfg.n_embd * cfg.block_size
    )


def test_no_bias_count():
    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, bias=False)
    assert GPT(cfg).num_params() == count_params(cfg)


def test_tied_weight_is_one_parameter():
    m = GPT(PRESETS["tiny"])
    assert m.lm_head.weight is m.wte.weight
    ids = [id(p) for p in m.parameters()]
    assert len(ids) == len(set(ids))
    assert sum(p is m.wte.weight for p in m.parameters()) == 1


def test_deterministic_construction():
    torch.manual_seed(3)
    a = GPT(PRESETS["tiny"]).state_dict()
    torch.manual_seed(3)
    b = GPT(PRESETS["tiny"]).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_init_statistics():
    torch.manual_seed(0)
    m = GPT(PRESETS["small"])
    assert torch.all(m.h[0].ln_1.weight == 1) and torch.all(m.h[0].attn.c_attn.bias == 0)
    assert abs(m.h[0].mlp.c_fc.weight.std().item() - 0.02) < 2e-3
    want = 0.02 / math.sqrt(2 * m.config.n_layer)
    assert abs(m.h[0].mlp.c_proj.weight.std().item() - want) < 1e-3


def test_forward_shapes_and_initial_loss():
    torch.manual_seed(0)
    cfg = PRESETS["tiny"]
    m = GPT(cfg)
    idx = torch.randint(0, cfg.vocab_size, (3, cfg.block_size))
    logits = m(idx)
    assert logits.shape == (3, cfg.block_size, cfg.vocab_size)
    # Targets independent of inputs: with a tied head, y == x would score above chance.
    tgt = torch.randint(0, cfg.vocab_size, idx.shape)
    logits, loss = m(idx, tgt)
    assert loss.dim() == 0 and loss.dtype == torch.float32
    assert abs(loss.item() - math.log(cfg.vocab_size)) < 0.3
    assert m(idx[:, :10]).shape == (3, 10, cfg.vocab_size)
    with pytest.raises(ValueError):
        m(torch.zeros(1, cfg.block_size + 1, dtype=torch.long))


def test_adamw_reduces_loss():
    torch.manual_seed(0)
    cfg = PRESETS["tiny"]
    m = GPT(cfg)
    x = torch.randint(0, cfg.vocab_size, (4, 32))
    y = torch.roll(x, -1, dims=1)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    losses = []
    for _ in range(10):
        _, loss = m(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_model_fp32_loss(dtype):
    torch.manual_seed(0)
    cfg = PRESETS["tiny"]
    m = GPT(cfg).to(dtype)
    assert m.lm_head.weight is m.wte.weight and m.wte.weight.dtype == dtype
    x = torch.randint(0, cfg.vocab_size, (2, cfg.block_size))
    logits, loss = m(x, torch.randint(0, cfg.vocab_size, x.shape))
    assert logits.dtype == dtype and loss.dtype == torch.float32
    assert torch.isfinite(loss) and abs(loss.item() - math.log(cfg.vocab_size)) < 0.5
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in m.parameters())


def test_dropout_configurable():
    cfg = GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=1, n_embd=16, dropout=0.5)
    m = GPT(cfg).train()
    x = torch.randint(0, 32, (2, 8))
    assert not torch.equal(m(x), m(x))
    m.eval()
    assert torch.equal(m(x), m(x))
