"""The Hugging Face Trainer on zerompi (zerompi/integrations/transformers.py; issue 42):
a tiny transformers GPT-2 trained by ZeroTrainer at 2 ranks, stages 0-3, tracks the same
model trained by the plain Trainer in one process, by the parity measure of the GPT tests
(tests/multirank/test_parity.py, support/parity_checks.py): the loss and the global
gradient norm of every step to 1e-5, the parameters within 16x the noise floor (the
reference rerun with its batch accumulated in other pieces); a run resumed from its
checkpoint-2 ends bitwise where it did; save_model's files load with from_pretrained. An
unmodified run_clm.py-style script runs under the launcher with a DeepSpeed config, and
resumes."""
import pytest

from batch import batched, worker
from parity_checks import ULP1

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

REF = worker(1, "hf_trainer", "ref", "{dir}", timeout=300)
ZERO = worker(2, "hf_trainer", "zero", "0,1,2,3", "{dir}", timeout=400)


def _max_diff(a, b):
    import torch

    return max((torch.tensor(a[k]) - torch.tensor(v)).abs().max().item() for k, v in b.items())


@batched(lambda: (REF, ZERO))
def test_trainer_on_zerompi_tracks_the_plain_trainer_and_resumes(result):
    ref, zero = result
    floor = _max_diff(ref["floor"]["params"], ref["ref"]["params"])
    tol = 16 * max(floor, ULP1)
    want = ref["ref"]["history"]
    assert len(want["loss"]) == len(want["grad_norm"]) == 4 and len(want["eval_loss"]) == 2, want
    for stage in (0, 1, 2, 3):
        d = zero[f"stage{stage}"]
        got = d["history"]
        assert d["stage"] == stage and d["global_steps"] == 4, (stage, d["stage"], d["global_steps"])
        assert got["lr"] == want["lr"], stage  # HF's linear schedule wrote the engine's lr
        for key in ("loss", "eval_loss"):
            assert len(got[key]) == len(want[key]), (stage, key)
            for x, y in zip(got[key], want[key]):
                assert abs(x - y) <= 1e-5, (stage, key, got[key], want[key])
        for x, y in zip(got["grad_norm"], want["grad_norm"]):
            assert abs(x - y) <= 1e-5 * y, (stage, got["grad_norm"], want["grad_norm"])
        diff = _max_diff(d["params"], ref["ref"]["params"])
        assert diff <= tol, (stage, diff, tol)
        assert d["resume_same"] and d["resumed_history"]["grad_norm"] == got["grad_norm"], stage
        assert d["saved_same"], stage  # save_model -> from_pretrained gives the engine's weights
        assert {"zerompi", "scheduler.pt", "trainer_state.json", "rng_state_1.pth"} <= set(d["files"]), d["files"]


@batched(lambda: worker(2, "hf_trainer", "launcher", "{dir}", timeout=400))
def test_unmodified_run_clm_style_script_runs_under_the_launcher_and_resumes(result):
    first, second = result["runs"]
    assert first == {**first, "class": "ZeroTrainer", "resumed_from": None, "global_step": 4}, first
    assert second["class"] == "ZeroTrainer" and second["resumed_from"].endswith("checkpoint-4"), second
    assert second["global_step"] == 6 and second["eval_loss"] < 4.2
    assert result["stage"] == 2  # the DeepSpeed file's zero_optimization.stage
    assert "zerompi" in result["checkpoint"] and "model.safetensors" in result["saved"]
