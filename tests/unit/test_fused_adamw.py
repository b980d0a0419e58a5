"""FusedShardAdamW's logic without a GPU: with the numpy executor (the table kernels'
references over numpy views of host ShardState buffers) against ShardedAdamW on the
same layouts, stages 0-3, fp32 and mixed precision, two groups, a skipped parameter."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from zerompi.kernels.adamw import fma32
from zerompi.optim import ShardedAdamW
from zerompi.optim.fused_adamw import FusedShardAdamW, NumpyExecutor, table_buffers

from shard_states import DTYPES, NUMELS, buffers_equal, clone, make_state, param_groups, set_grads


def _torch_sqrt(x):  # torch's CPU sqrt: the numpy executor then matches torch bit for bit
    return torch.from_numpy(np.ascontiguousarray(x)).sqrt().numpy()


def _torch_fma() -> bool:
    """Whether torch's vectorised CPU lerp fuses (AVX2/AVX512/NEON: yes)."""
    rng = np.random.default_rng(0)
    m, g = (rng.standard_normal(4096).astype(np.float32) for _ in range(2))
    t = torch.from_numpy(m.copy()).lerp_(torch.from_numpy(g), 0.1).numpy()
    return np.array_equal(t, fma32(np.float32(0.1), g - m, m))


def _run(stage, dtypes, executor, weights=None):
    """Three steps of both optimizers on identical states; returns both states and the
    norms each step."""
    ref_st, segs = make_state(stage, *dtypes)
    st = clone(ref_st)
    ref = ShardedAdamW(segs, ref_st.views, param_groups(), len(NUMELS))
    fused = FusedShardAdamW(segs, st, param_groups(), len(NUMELS), executor=executor, tile=8)
    norms = []
    for k, (coef, used) in enumerate([(1.0, None), (0.37, [True, False] + [True] * 5),
                                      (2.0 ** -7, None)]):
        set_grads([ref_st, st], seed=10 + k)
        w = weights if weights is not None else [1.0 if s.param % 2 else 0.5 for s in segs]
        norms.append((float(ref.grad_sq_norm(w)), fused.grad_sq_norm(w)))
        ref.step(coef, used)
        fused.step(coef, used)
        for opt in (ref, fused):  # an LR schedule edits param_groups between steps
            opt.param_groups[1]["lr"] *= 0.5
    return ref, fused, ref_st, st, norms


@pytest.mark.parametrize("dtypes", DTYPES, ids=lambda d: f"{d[0]}/{d[1]}".replace("torch.", ""))
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_fused_matches_sharded_adamw(stage, dtypes):
    ref, fused, ref_st, st, norms = _run(stage, dtypes, NumpyExecutor(fma=_torch_fma(), sqrt=_torch_sqrt))
    assert fused.table.ntiles > len(fused.segments)  # tile=8: segments span several tiles
    assert buffers_equal(ref_st, st) == [], f"stage {stage} {dtypes}"
    assert fused.steps == ref.steps == [3, 2, 3, 3, 3, 3, 3]
    for want, got in norms:
        assert isinstance(got, torch.Tensor) and got.dtype == torch.float64 and got.dim() == 0
        assert float(got) == pytest.approx(want, rel=1e-12, abs=0)


@pytest.mark.parametrize("stage", [0, 3])
def test_fused_kernel_arithmetic_within_an_ulp_of_torch(stage):
    """Default executor = the kernels' arithmetic: sqrt correctly rounded, torch's CPU
    sqrt up to 1 ulp off, which moves an update by an ulp of its size (lr <= 0.05 here)
    and can flip the rounding of p + update; moments are unaffected."""
    _, _, ref_st, st, _ = _run(stage, DTYPES[0], NumpyExecutor())
    for name, t in ref_st.buffers().items():
        got, want = st.buffers()[name].numpy(), t.numpy()
        err = np.abs(got - want)
        tol = 0 if "exp_avg" in name else 2 * np.spacing(np.abs(want)) + 4 * np.spacing(np.float32(0.05))
        assert np.all(err <= tol), (name, err.max())


def test_table_offsets_are_the_views():
    """The table's offsets select exactly the memory ShardState.views hands ShardedAdamW."""
    for stage in range(4):
        for dtypes in DTYPES[:2]:
            st, segs = make_state(stage, *dtypes)
            bufs, (mo, go, vo, oo) = table_buffers(st, segs)
            for k, s in enumerate(segs):
                master, grad, m, v, low = st.views(s.shard_lo, s.flat_lo, s.length)
                for view, base, off in ((master, "master", mo), (grad, "grad", go),
                                        (m, "exp_avg", vo), (v, "exp_avg_sq", vo), (low, "out", oo)):
                    if view is None:
                        assert bufs[base] is None
                        continue
                    b = bufs[base]
                    assert view.data_ptr() == b.data_ptr() + int(off[k]) * b.element_size(), (stage, base)


def test_overflow_weights_and_state_dict():
    st, segs = make_state(2, torch.bfloat16, torch.bfloat16)
    fused = FusedShardAdamW(segs, st, param_groups(), len(NUMELS))
    assert isinstance(fused.executor, NumpyExecutor)  # host placement
    set_grads([st], seed=3)
    ref = ShardedAdamW(segs, st.views, param_groups(), len(NUMELS))
    assert float(fused.grad_sq_norm()) == pytest.approx(float(ref.grad_sq_norm()), rel=1e-12)
    zero = [0.0] * len(segs)
    assert float(fused.grad_sq_norm(zero)) == 0.0
    st.grad_shard[5] = float("nan")
    assert float(fused.grad_sq_norm()) == float("inf")
    assert float(fused.grad_sq_norm(zero)) == float("inf")  # overflow whatever the weights
    with pytest.raises(ValueError, match="weights for"):
        fused.grad_sq_norm([1.0])
    # nothing used: no update, no step counted
    before = st.master.clone()
    fused.step(1.0, [False] * len(NUMELS))
    assert fused.steps == [0] * len(NUMELS) and torch.equal(before, st.master)
    sd = {"steps": [4, 0, 1, 2, 3, 4, 5], "param_groups": [dict(g, lr=0.5) for g in param_groups()]}
    fused.load_hyper_state(sd)
    assert fused.hyper_state()["steps"] == sd["steps"] and fused.param_groups[1]["lr"] == 0.5
    rows = fused.step_rows(0.5, [True, False, True, True, True, True, True])
    active = rows[:, 8] == 1
    assert active.tolist() == [s.param != 1 for s in segs]
