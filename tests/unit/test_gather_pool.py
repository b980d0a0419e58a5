"""Stage 3's gather pool (zerompi/zero/stage3/gather_pool.py) in one process: slot sizes from the
layout, lending and giving back slots. On a reference GPT over 2 ranks (the same pool
memory step after step, results bitwise those without the pool, a counted fallback):
tests/multirank/test_stage3.py."""
import pytest
import torch

from zerompi.device import Placement
from zerompi.zero.stage3 import gather_pool
from zerompi.zero.stage3.gather_pool import GatherPool, ancestors, capacities

# GPT-like: units in flat (backward) order, the model's own unit last
GPT = ["h.3", "h.2", "h.1", "h.0", "<root>"]
GPT_SIZES = [100, 100, 100, 100, 30]


def test_capacities_window_of_the_unit_its_encloser_and_prefetch():
    flags = [False] * 5
    assert ancestors(GPT, flags) == [{4}, {4}, {4}, {4}, set()]
    assert capacities(GPT, flags, GPT_SIZES, 1, 1 << 30) == [100, 100, 30]
    assert capacities(GPT, flags, GPT_SIZES, 0, 1 << 30) == [100, 30]
    assert capacities(GPT, flags, GPT_SIZES, 2, 1 << 30) == [100, 100, 100, 30]
    # max_live_parameters stops the prefetch as PartitionedParams._predictions does
    assert capacities(GPT, flags, GPT_SIZES, 2, 230) == [100, 100, 30]
    assert capacities(GPT, flags, GPT_SIZES, 1, 130) == [100, 30]


def test_capacities_persistent_coalesced_and_nested():
    # persistent unit: its own buffer, never a slot
    names = GPT + ["<persistent>"]
    assert capacities(names, [False] * 5 + [True], GPT_SIZES + [7], 1, 1 << 30) == [100, 100, 30]
    # the model's unit took in h.0 (coalescing): it encloses the others, and is the biggest
    names = ["h.2+h.3", "h.1", "h.0+<root>"]
    assert ancestors(names, [False] * 3) == [{2}, {2}, set()]
    assert capacities(names, [False] * 3, [200, 100, 130], 1, 1 << 30) == [200, 130, 100]
    # a layer unit around expert units, inside the model's unit: three levels live at once
    names = ["l.1.e.1", "l.1.e.0", "l.1", "l.0.e.1", "l.0.e.0", "l.0", "<root>"]
    sizes = [50, 50, 20, 50, 50, 20, 10]
    anc = ancestors(names, [False] * 7)
    assert anc[0] == {2, 6} and anc[2] == {6} and anc[6] == set()
    # windows: (e.1, e.0 | l.1, root) and (l.1 + next l.0.e.1 | l.0, root): [50, 50, 20, 10], [50, 20, 20, 10]
    assert capacities(names, [False] * 7, sizes, 1, 1 << 30) == [50, 50, 20, 10]


def test_lend_and_give_back_swap_memory_into_the_units_own_storage():
    if not gather_pool.available():
        pytest.skip("torch without UntypedStorage._swap_data_ptr_")
    pool = GatherPool(Placement(), torch.float32, [8, 4])
    assert pool.nbytes == 48 and [s.numel for s in pool.free] == [4, 8]
    t, slot = pool.buffer(3)              # best fit: the 4-element slot
    view = t[1:3]
    assert slot.numel == 4 and t.untyped_storage().nbytes() == 16
    t.copy_(torch.tensor([1.0, 2.0, 3.0]))
    pool.give_back(t, slot)
    assert t.untyped_storage().nbytes() == 0 and view.untyped_storage().nbytes() == 0
    slot2 = pool.lend(t)                  # the same memory comes back, values kept
    assert slot2 is slot and torch.equal(view, torch.tensor([2.0, 3.0]))
    big, extra = torch.empty(5), torch.empty(5)
    big.untyped_storage().resize_(0)
    extra.untyped_storage().resize_(0)
    s8 = pool.lend(big)
    fresh = pool.lend(extra)              # nothing free fits: a fresh buffer, counted
    assert fresh.fresh and pool.fallbacks == 1 and pool.fallback_bytes == 20
    pool.give_back(extra, fresh)
    pool.give_back(big, s8)
    pool.give_back(t, slot2)
    assert pool.fallback_bytes == 0 and [s.numel for s in pool.free] == [4, 8]
    empty, none = pool.buffer(0)          # a unit of empty parameters takes no slot
    assert none is None and empty.numel() == 0 and len(pool.free) == 2
    pool.give_back(empty, none)
