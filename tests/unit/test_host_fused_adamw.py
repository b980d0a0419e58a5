"""HostFusedAdamW (torch's fused CPU AdamW over the offloaded host shard) against
ShardedAdamW on the same offloaded states: stages 0-3, fp32 and mixed precision, two
groups with their own hyper-parameters, a skipped parameter, unscale x clip coefficients,
an LR schedule between steps. Not bitwise (fused arithmetic), so a few ulps apart."""
from __future__ import annotations

import pytest
import torch

from zerompi.optim import HostFusedAdamW, ShardedAdamW
from zerompi.optim.host_fused import available

from shard_states import DTYPES, NUMELS, clone, make_state, param_groups, set_grads

pytestmark = pytest.mark.skipif(not available(), reason="this torch has no torch._fused_adamw_")


def _run(stage, dtypes):
    ref_st, segs = make_state(stage, *dtypes, offload=True)
    st = clone(ref_st)
    ref = ShardedAdamW(segs, ref_st.views, param_groups(), len(NUMELS))
    fused = HostFusedAdamW(segs, st.views, param_groups(), len(NUMELS))
    for k, (coef, used) in enumerate([(1.0, None), (0.37, [True, False] + [True] * 5),
                                      (2.0 ** -7, None), (1.0, None)]):
        set_grads([ref_st, st], seed=10 + k)
        for s in (ref_st, st):
            s.offload_grads()
        ref.step(coef, used)
        fused.step(coef, used)
        for opt in (ref, fused):
            opt.param_groups[1]["lr"] *= 0.5
    return ref, fused, ref_st, st


@pytest.mark.parametrize("dtypes", DTYPES, ids=lambda d: f"{d[0]}/{d[1]}".replace("torch.", ""))
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_host_fused_tracks_sharded_adamw(stage, dtypes):
    ref, fused, ref_st, st = _run(stage, dtypes)
    assert fused.steps == ref.steps == [4, 3, 4, 4, 4, 4, 4]
    start, _ = make_state(stage, *dtypes, offload=True)
    for name in ("master", "exp_avg", "exp_avg_sq"):
        want, got = getattr(ref_st, name), getattr(st, name)
        moved = (want - getattr(start, name)).abs()
        assert moved.max() > 0, name  # the update did something to compare
        # a few ulps of the value, and of lr-sized updates (fused rounding, not the math)
        tol = 8 * torch.finfo(torch.float32).eps * (want.abs() + 0.05)
        assert torch.all((got - want).abs() <= tol), (name, (got - want).abs().max())
    # the device copy is the master rounded to the parameter dtype, as ShardedAdamW writes it
    for (p, _, _, _, lowp) in fused.views:
        assert torch.equal(lowp, p.to(lowp.dtype))


def test_skipped_parameter_is_untouched():
    """used[i] False: no decay, no moment update, its step count stays (as torch)."""
    st, segs = make_state(2, torch.float32, torch.float32, offload=True)
    before = clone(st)
    opt = HostFusedAdamW(segs, st.views, param_groups(), len(NUMELS))
    set_grads([st], seed=3)
    st.offload_grads()
    opt.step(0.5, [True, False] + [True] * 5)
    for s, (p, _, m, v, _) in zip(segs, opt.views):
        b = before.views(s.shard_lo, s.flat_lo, s.length)
        same = torch.equal(p, b[0]) and torch.equal(m, b[2]) and torch.equal(v, b[3])
        assert same == (s.param == 1), s


def test_needs_fp32_host_gradients():
    st, segs = make_state(2, torch.bfloat16, torch.bfloat16)  # not offloaded: bf16 gradients
    with pytest.raises(ValueError, match="HostFusedAdamW: parameter 0 has a torch.bfloat16 gradient"):
        HostFusedAdamW(segs, st.views, param_groups(), len(NUMELS))
