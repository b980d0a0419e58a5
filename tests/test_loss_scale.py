"""Dynamic loss scaling: the scaler's rules, and agreement across ranks on overflow."""
import pytest

from mpirun import run_worker
from zerompi.config import LossScaleConfig
from zerompi.precision import DynamicLossScaler


def test_scaler_window_hysteresis_and_minimum():
    s = DynamicLossScaler(LossScaleConfig(initial_scale=16, window=3, hysteresis=2, min_scale=2))
    s.update(True)            # first overflow eaten by hysteresis
    assert s.scale == 16
    s.update(True)            # second lowers
    assert s.scale == 8
    for _ in range(3):        # a clean window raises and restores the hysteresis budget
        s.update(False)
    assert s.scale == 16 and s.hysteresis_left == 2
    seq = []
    for _ in range(4):        # budget 2: first overflow eaten, then each one halves
        s.update(True)
        seq.append(s.scale)
    assert seq == [16, 8, 4, 2]
    with pytest.raises(FloatingPointError, match="fp16.min_scale=2"):
        s.update(True)        # overflowing at the minimum: diverged, not an endless skip loop
    state = s.state_dict()
    t = DynamicLossScaler(LossScaleConfig(initial_scale=16, window=3, hysteresis=2, min_scale=2))
    t.load_state_dict(state)
    assert t.state_dict() == state


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_overflow_on_one_rank_skips_everywhere(stage, tmp_path):
    r = run_worker(3, "overflow", ["--stage", str(stage)], tmp_path)
    logs = r["logs"]
    assert all(l == logs[0] for l in logs)  # every rank saw exactly the same history
    log = logs[0]
    assert [e["updated"] for e in log] == [True, True, False, True, True, True]
    assert log[2]["unchanged"] and not log[1]["unchanged"] and not log[3]["unchanged"]
    # 256 -> (window 2) 512 after two clean steps -> overflow halves to 256 -> 512 after two more
    assert [e["scale"] for e in log] == [256, 512, 256, 256, 512, 512]
    assert log[-1]["skipped"] == 1
