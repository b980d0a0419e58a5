"""Dynamic loss scaling's rules (zerompi/precision.py): window, hysteresis, minimum, state
dict. Agreement across ranks on an overflow: tests/multirank/test_loss_scale.py."""
import pytest

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
