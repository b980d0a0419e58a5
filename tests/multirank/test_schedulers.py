"""torch LR schedulers and DeepSpeed scheduler blocks driving the engine on 2 and 3 ranks,
stages 0-3 (each schedule at two stages per world size): the learning rate of every update
is the schedule's formula on a plain torch optimizer (torch's own scheduler; DeepSpeed's
blocks through optim/ds_schedules.py, which tests/unit/test_ds_schedules.py ties to
DeepSpeed's code), and a run saved after 3 updates, loaded into a new engine with a new
scheduler and continued gives the same lrs and bitwise the same parameters."""
import pytest

from batch import batched, worker

KINDS = ["LambdaLR", "OneCycleLR", "CosineAnnealingLR", "SequentialLR",
         "WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle"]


def _cases(n):
    # every kind at two stages; the stages rotate so that each world size covers 0-3
    return ",".join(f"{k}:{(i + s + n) % 4}" for i, k in enumerate(KINDS) for s in (0, 2))


def _case(n):
    return worker(n, "schedulers", "--dir", "{dir}", "--cases", _cases(n), timeout=400)


@batched(_case)
@pytest.mark.parametrize("n", [2, 3])
def test_schedulers_follow_their_formula_and_resume(n, result):
    assert sorted(result) == sorted(_cases(n).split(","))
    for case, r in result.items():
        flat = lambda lrs: [x for row in lrs for x in row]  # noqa: E731
        assert flat(r["whole"]) == pytest.approx(flat(r["formula"]), rel=1e-12, abs=0), case
        assert r["resumed"] == r["whole"], case
        assert r["param_diff"] == 0.0, case
        assert len({lr[0] for lr in r["whole"]}) > 2, case  # the schedule moves
