"""The update's coefficient computed where the norm is (zerompi/zero/step_coef.py), and the
engine's step with that decision read a step late (defer_stats, the GPU's way), checked
on the CPU: the coefficient is the host formula's bit for bit, and a deferred run is the
immediate run, bitwise, through clipping, a non-finite step and its bookkeeping."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import zerompi
from zerompi.precision import Diverged
from zerompi.zero import step_coef


def _host_coef(sumsq: float, scale: float, unapplied: float, clip: float) -> tuple[float, float]:
    """The engine's host arithmetic before the coefficient moved to the device."""
    norm = math.sqrt(sumsq) * unapplied / scale if unapplied != 1.0 else math.sqrt(sumsq) / scale
    coef = unapplied / scale
    if clip > 0:
        cc = clip / (norm + 1e-6)
        if cc < 1.0:
            coef = float(torch.tensor(cc, dtype=torch.float32)) * coef
    return norm, float(np.float32(coef))


def test_coefficient_is_the_host_formula():
    rng = np.random.default_rng(3)
    for sumsq in list(rng.uniform(0, 10, 40) ** 4) + [0.0, 1e-30, 0.25]:
        for scale in (1.0, 2.0 ** 12):
            for unapplied in (1.0, 0.5, 1 / 3):
                for clip in (0.0, 0.5, 1.0):
                    kern, host = step_coef.coefficient(torch.tensor(sumsq, dtype=torch.float64),
                                                       scale, unapplied, clip)
                    norm, coef = _host_coef(sumsq, scale, unapplied, clip)
                    assert kern.dtype == torch.float32 and kern.tolist() == [coef, 0.0]
                    assert host.tolist() == [norm, 0.0, coef]
    for bad in (math.inf, math.nan):
        kern, host = step_coef.coefficient(torch.tensor(bad, dtype=torch.float64), 1.0, 1.0, 1.0)
        assert kern.tolist() == [0.0, 1.0] and host[1] == 1.0  # skipped; a finite coefficient


CASES = [(sq, sc, u, c) for sq in list(np.random.default_rng(4).uniform(0, 10, 30) ** 4) + [0.0, 0.25]
         for sc in (1.0, 2.0 ** 12) for u in (1.0, 1 / 3) for c in (0.0, 0.5)]


def test_device_arithmetic_on_the_cpu():
    """The tensor branch (the GPU's) run on CPU tensors: torch's CPU sqrt may be an ulp
    off (CUDA's is IEEE: test_coefficient_on_the_gpu), so the norm within 2 ulps and the
    float32 coefficient within one."""
    for sq, sc, u, c in CASES:
        kern, host = step_coef._on_device(torch.tensor(sq, dtype=torch.float64), sc, u, c)
        norm, coef = _host_coef(sq, sc, u, c)
        assert host[0].item() == pytest.approx(norm, rel=5e-16, abs=0) and host[1] == 0 == kern[1]
        assert kern[0].item() == pytest.approx(coef, rel=1.2e-7) and host[2].item() == kern[0].item()
    kern, host = step_coef._on_device(torch.tensor(math.nan, dtype=torch.float64), 1.0, 1.0, 1.0)
    assert kern.tolist() == [0.0, 1.0] and host[1] == 1.0


def test_coefficient_on_the_gpu():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    for sq, sc, u, c in CASES:
        kern, host = step_coef.coefficient(torch.tensor(sq, dtype=torch.float64, device="cuda"), sc, u, c)
        assert kern.is_cuda and host.cpu().tolist() == [*_host_coef(sq, sc, u, c)[:1], 0.0,
                                                        _host_coef(sq, sc, u, c)[1]]
        assert kern.cpu().tolist() == [_host_coef(sq, sc, u, c)[1], 0.0]


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.unused = torch.nn.Linear(6, 8), torch.nn.Linear(8, 3), torch.nn.Linear(2, 2)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x))).square().mean()


def _run(defer: bool, steps=6, bad=(2,), gas=2, max_nonfinite=3):
    torch.manual_seed(0)
    eng = zerompi.initialize(_Net(), {"stage": 2, "precision": "fp32", "gradient_clipping": 0.05,
                                      "gradient_accumulation_steps": gas,
                                      "max_nonfinite_steps": max_nonfinite,
                                      "optimizer": {"lr": 1e-2, "implementation": "fused"}})
    assert eng.reducer.local and eng.reducer.unapplied == 1.0
    eng.defer_stats = defer
    g = torch.Generator().manual_seed(1)
    norms, returned, skipped = [], [], []
    for step in range(steps):
        for _ in range(gas):
            loss = eng(torch.randn(4, 6, generator=g))
            eng.backward(loss * (math.inf if step in bad else 1.0))
            returned.append(eng.step())
        assert (eng._pending is not None) == defer  # deferred: decided, not read yet
        norms.append(eng.last_grad_norm)  # a read settles it
        skipped.append(eng.skipped_steps)
    return eng, norms, returned, skipped


def test_deferred_step_is_the_immediate_step():
    imm, n_imm, r_imm, s_imm = _run(False)
    dfr, n_dfr, r_dfr, s_dfr = _run(True)
    assert n_imm == n_dfr and math.isinf(n_imm[2]) and all(0 < n < math.inf for k, n in enumerate(n_imm) if k != 2)
    assert s_imm == s_dfr == [0, 0, 1, 1, 1, 1]
    assert imm.global_steps == dfr.global_steps == 5 and imm.optimizer.steps == dfr.optimizer.steps
    assert min(imm.optimizer.steps) == 0 and max(imm.optimizer.steps) == 5  # the unused layer: none
    # the immediate step says False for the skip; the deferred one had issued it
    assert r_imm[5] is False and r_dfr[5] is True and r_imm[:5] == r_dfr[:5]
    a, b = imm.full_state_dict(), dfr.full_state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    for kind in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(getattr(imm.state, kind), getattr(dfr.state, kind))


def test_deferred_step_is_applied_and_read_late():
    """The update is made before anything is read: the parameters have moved while the
    step's norm is still pending; reading a counter settles it."""
    torch.manual_seed(0)
    eng = zerompi.initialize(_Net(), {"stage": 3, "precision": "bf16", "gradient_clipping": 1.0,
                                      "optimizer": {"implementation": "fused"}})
    eng.defer_stats = True
    before = eng.full_state_dict()
    eng.backward(eng(torch.randn(4, 6)))
    assert eng.step() is True and eng._pending is not None
    after = eng.full_state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert eng._pending is not None  # full_state_dict reads no counter
    assert eng.global_steps == 1 and eng._pending is None and 0 < eng.last_grad_norm < math.inf


def test_deferred_nonfinite_streak_stops_the_run():
    with pytest.raises(Diverged, match="3 steps in a row"):
        _run(True, steps=6, bad=(1, 2, 3), max_nonfinite=3)
