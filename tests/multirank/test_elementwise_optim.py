"""SGD (momentum, nesterov, dampening, weight decay) and Adagrad (lr_decay, initial
accumulator, weight decay) over the shard, stages 0-3 at N = 2 and an uneven N = 3,
against single-process torch.optim on the same global batch with clipping on (the
tolerances of tests/multirank/test_parity.py: support/parity_checks.py); and a run saved
mid-way and resumed in a new engine continues bitwise (their states go through the
engine's checkpoints: optim/elementwise.py)."""
import pytest

from batch import batched, worker
from parity_checks import ULP1

STAGES = {2: "sgd:0,sgd:2,adagrad:1,adagrad:3,sgd_damp:3",
          3: "sgd:1,sgd:3,adagrad:0,adagrad:2,sgd_damp:1"}


@batched(lambda n: worker(n, "elementwise", "--dir", "{dir}", "--cases", STAGES[n], timeout=400))
@pytest.mark.parametrize("n", [2, 3])
def test_sgd_and_adagrad_match_torch_and_resume(n, result):
    assert sorted(result) == sorted(STAGES[n].split(","))
    for case, r in result.items():
        assert r["optimizer"] == ("ShardAdagrad" if case.startswith("adagrad") else "ShardSGD"), case
        assert r["max_diff"] <= 16 * max(r["floor"], ULP1), (case, r["max_diff"], r["floor"])
        for a, b in zip(r["losses"], r["ref_losses"]):
            assert abs(a - b) <= 1e-5, (case, a, b)
        assert r["resume_diff"] == 0.0, case
