"""Every buffer of model state is allocated through the ShardState's Placement."""
import pytest
import torch

from zerompi.device import Placement
from zerompi.zero.partition import FlatLayout
from zerompi.zero.state import ShardState


@pytest.mark.parametrize("replicated,full_grads,dtype", [
    (True, True, torch.float32), (True, False, torch.bfloat16), (False, False, torch.float16)])
def test_every_state_buffer_lands_on_the_placement(replicated, full_grads, dtype):
    # 'meta' allocates nothing: a buffer created anywhere but through the placement
    # would be on the CPU and fail this check.
    layout = FlatLayout([100, 7, 33], world=3, block=48, align=4)
    st = ShardState(layout, layout.chunks(1), Placement.of("meta"), dtype, dtype,
                    replicated=replicated, full_grads=full_grads)
    bufs = st.buffers()
    assert bufs and all(t.device.type == "meta" for t in bufs.values()), {k: t.device for k, t in bufs.items()}
    assert ("flat_param" in bufs) == replicated and ("shard_param" in bufs) != replicated
    assert ("flat_grad" in bufs) == full_grads and ("grad_shard" in bufs) != full_grads
    assert ("master" in bufs) == (dtype != torch.float32)
    owned = sum(c.size for c in layout.chunks(1))
    assert bufs["exp_avg"].numel() == owned == layout.shard_size


def test_engine_buffers_are_on_its_placement():
    import zerompi

    for stage in (0, 2, 3):
        eng = zerompi.initialize(torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 2)),
                                 {"stage": stage, "precision": "bf16"})
        assert str(eng.state.placement) == "host"
        dev = eng.state.placement.device
        assert all(t.device == dev for t in eng.state.buffers().values())
        assert eng.reducer.local and eng.reducer.slots_free == []  # alone: no buckets
    # over 2 ranks the reducer's buckets come through the placement too ('meta': see above)
    from zerompi.zero.grads import SCATTER_PER_BUCKET, GradReducer

    params = [torch.nn.Parameter(torch.zeros(100, device="meta")), torch.nn.Parameter(torch.zeros(7, device="meta"))]
    layout = FlatLayout([100, 7], world=2, block=48, align=4)
    st = ShardState(layout, layout.chunks(1), Placement.of("meta"), torch.bfloat16, torch.bfloat16,
                    replicated=True, full_grads=False)
    slots = GradReducer(params, layout, None, SCATTER_PER_BUCKET, st, 2, torch.float32).slots_free
    assert slots and all(t.device.type == "meta" for s in slots for t in (s.bucket, s.recv, s.scratch))


def test_placement_rules():
    with pytest.raises(ValueError, match="only host memory can be pinned"):
        Placement.of("cuda:0", pinned=True)
    assert str(Placement()) == "host" and not Placement().is_cuda
    assert Placement.of("cuda:1").is_cuda and str(Placement.of("cuda:1")) == "cuda:1"


def test_pinned_host_placement(cuda):
    t = Placement(pinned=True).zeros(16, torch.float32)
    assert t.is_pinned() and t.device.type == "cpu"


def test_cuda_placement_allocates_on_the_device(cuda):
    layout = FlatLayout([1000], world=2, block=256)
    st = ShardState(layout, layout.chunks(0), Placement.of("cuda:0"), torch.bfloat16, torch.bfloat16,
                    replicated=False, full_grads=False)
    assert all(t.is_cuda for t in st.buffers().values())
