"""Stage-3 unit coalescing in the planner (zerompi/zero/stage3/units.py), no MPI: consecutive
sibling units below stage3.coalesce_elements merge into one multi-root unit; nothing
else about the plan changes. The engine-side behaviour (gather at the first root,
release after the last, data-dependent roots) is checked by tests/multirank/test_parity.py and
tests/multirank/test_stage3_models.py with --coalesce."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from zerompi.config import ConfigError, ZeroConfig, load
from zerompi.zero.stage3 import units


class Block(nn.Module):
    def __init__(self, d: int = 8):
        super().__init__()
        self.a = nn.Linear(d, d)       # 72 elements
        self.b = nn.Linear(d, d)
        self.scale = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return self.b(self.a(x)) * self.scale


class Net(nn.Module):
    def __init__(self, layers: int = 5):
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.h = nn.ModuleList(Block() for _ in range(layers))   # 152 elements each
        self.ln = nn.LayerNorm(8)


def _plan(model, target, **s3):
    cfg = load({"stage": 3, "stage3": s3})
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return units.plan(model, trainable, cfg, coalesce_below=target), trainable


def test_off_by_default_and_below_one_unit():
    model = Net()
    model.emb = nn.Embedding(100, 8)
    for target in (0, 152):   # 0: off; 152: every unit already reaches it
        plan, _ = _plan(model, target)
        assert sorted(plan.unit_names) == sorted(["<root>"] + [f"h.{i}" for i in range(5)])
        assert all(len(r) == 1 for r in plan.unit_roots)


def test_pairs_and_a_short_tail_joins_the_previous_group():
    model = Net()
    base, trainable = _plan(model, 0)
    plan, _ = _plan(model, 300)   # two layers
    # backward order: the last group first; h.4 alone would be below 300, so it joins
    # h.2+h.3; the model's own unit (96 elements) takes in h.0 and h.1, enclosing root last
    assert plan.unit_names == ["h.2+h.3+h.4", "h.0+h.1+<root>"]
    assert plan.unit_roots[0] == (model.h[2], model.h[3], model.h[4])
    assert plan.unit_roots[1] == (model.h[0], model.h[1], model)
    # the same parameters, each once; each unit's parameters contiguous, backward order within
    assert sorted(n for n, _ in plan.order) == sorted(n for n, _ in base.order)
    assert sum(plan.unit_sizes) == len(trainable) and plan.unit_persistent == [False] * 2
    first = [n for n, _ in plan.order[:plan.unit_sizes[0]]]
    assert first == [n for i in (4, 3, 2) for n in
                     [f"h.{i}.{m}.{k}" for m in ("b", "a") for k in ("bias", "weight")] + [f"h.{i}.scale"]]


def test_everything_below_a_huge_target_but_never_the_model_or_persistent():
    model = Net()
    plan, _ = _plan(model, 10 ** 9, persistence_threshold=8)
    assert plan.unit_names == ["h.0+h.1+h.2+h.3+h.4+<root>", "<persistent>"]
    assert plan.unit_roots[-1] is None
    # a model unit already at the target stays alone; the layers merge among themselves
    big = Net()
    big.emb = nn.Embedding(100, 8)                      # 800 elements
    plan, _ = _plan(big, 700)
    assert plan.unit_names == ["h.0+h.1+h.2+h.3+h.4", "<root>"]


def test_only_leaf_siblings_merge():
    """Nested unit classes: a Block (its own `scale`) encloses its Linears' units, so
    Blocks never merge; the Linears merge only with their siblings inside the same Block."""
    model = Net(layers=2)
    model.emb = nn.Embedding(1000, 8)                   # the model's unit above the target
    plan, _ = _plan(model, 1000, unit_classes="Block,Linear")
    assert sorted(plan.unit_names) == sorted(["<root>", "h.0", "h.1", "h.0.a+h.0.b", "h.1.a+h.1.b"])


def test_target_from_config():
    s3 = ZeroConfig().stage3
    assert s3.coalesce_elements == "auto"
    assert units.coalesce_target(s3, 1 << 28, True) == 1 << 28    # "auto" above the 2^22 floor
    assert units.coalesce_target(s3, 1 << 22, False) == 0          # small N: off
    forced = load({"stage": 3, "stage3": {"coalesce_elements": 500}}).stage3
    assert units.coalesce_target(forced, 1 << 22, False) == 500
    with pytest.raises(ConfigError):
        load({"stage": 3, "stage3": {"coalesce_elements": -1}})
