"""Dynamic loss scaling: agreement across ranks on an overflow (the scaler's rules:
tests/unit/test_loss_scaler.py)."""
import pytest

from batch import batched, worker


@batched(lambda stage: worker(3, "overflow", "--stage", str(stage)))
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_overflow_on_one_rank_skips_everywhere(stage, result):
    r = result
    logs = r["logs"]
    assert all(l == logs[0] for l in logs)  # every rank saw exactly the same history
    log = logs[0]
    assert [e["updated"] for e in log] == [True, True, False, True, True, True]
    assert log[2]["unchanged"] and not log[1]["unchanged"] and not log[3]["unchanged"]
    # 256 -> (window 2) 512 after two clean steps -> overflow halves to 256 -> 512 after two more
    assert [e["scale"] for e in log] == [256, 512, 256, 256, 512, 512]
    assert log[-1]["skipped"] == 1
