"""Tensor parallelism x ZeRO-DP on the reference GPT against single-process AdamW
(tests/workers/tp_parity.py): tp = 2 x dp = 1 and tp = 2 x dp = 2, stages 0-3, with
activation checkpointing off, plain, partitioned (Pa) and partitioned + offloaded;
tp-invariant initialisation; the estimator's dry run at the same tp (memory terms, padded
T, buffers, stage 3's pool, exact); a checkpoint saved at tp 2 x dp 2 resumed at tp 1 x dp 3.
The vocabulary (300) is padded to 512 at tp = 2: padding must never be trained. The
cases run in their world size's batch (support/batch.py); the trainer at tp = 2:
tests/system/test_train.py."""
import pytest

from batch import batched
from parity_checks import check_fp32, tp_parity

# saved by one case (N = 4) for another (N = 3): the batch runs the saver first
SAVE_TP2_DP2 = tp_parity(4, "--tp", "2", "--stages", "2", "--steps", "2", "--save", "{tmp}/tp2dp2-ckpt")


def _check(r, stages=(0, 1, 2, 3), gpt=True):
    check_fp32(r, stages=stages)
    for s in stages:
        d = r[f"stage{s}"]
        assert d["init_mismatch"] == [], (s, d["init_mismatch"])
        assert d["shapes_full"], s
        # the estimator's dry run at this tp lays out exactly what this engine built
        assert ("estimate" in d) == (r["tp"] > 1 and gpt), s
        for k, v in d.get("estimate", {}).items():
            assert k in d["memory"] or k == "gather_pool" and v == 0, (s, k)  # the pool: stage 3 only
            assert d["memory"].get(k, 0) == v, (s, k, d["memory"].get(k), v)


@batched(lambda n, act: tp_parity(n, "--tp", "2", "--act", act))
@pytest.mark.parametrize("n,act", [(2, "none"), (4, "none"), (2, "partition"), (4, "plain"),
                                   (4, "partition"), (4, "offload")])
def test_tp2_matches_adamw_every_stage(n, act, result):
    assert result["tp"] == 2 and result["world"] == n
    _check(result)


@batched(lambda: tp_parity(4, "--tp", "2", "--stages", "1,3", "--impl", "fused"))
def test_tp2_dp2_fused_optimizer(result):
    """The fused optimizer's weighted norm (tp replicas weighted 1/tp in the table)."""
    _check(result, stages=(1, 3))


@batched(lambda: tp_parity(4, "--tp", "4", "--stages", "1,3"))
def test_tp4_matches_adamw(result):
    """Four heads over four ranks: one head per rank; stages 1 and 3."""
    _check(result, stages=(1, 3))


@batched(lambda: (SAVE_TP2_DP2, tp_parity(3, "--tp", "1", "--stages", "3", "--start", "2", "--steps", "3",
                                          "--load", "{tmp}/tp2dp2-ckpt", needs=(SAVE_TP2_DP2,))))
def test_checkpoint_tp2_dp2_resumes_at_tp1_dp3(result):
    """Saved at tp 2 x dp 2 after 2 steps (stage 2), loaded at tp 1 x dp 3 (stage 3),
    3 more steps: parity with 5 uninterrupted single-process steps."""
    saved, r = result
    assert saved["tp"] == 2 and saved["world"] == 4 and "stage2" in saved
    _check(r, stages=(3,))


@batched(lambda n, stages, act: tp_parity(n, "--tp", "2", "--family", "llama", "--stages", stages, "--act", act))
@pytest.mark.parametrize("n,stages,act", [(2, "1,3", "partition"), (4, "0,2", "none"), (4, "3", "plain")])
def test_llama_tp2_matches_adamw(n, stages, act, result):
    """The Llama family (GQA: 4 query heads over 2 kv heads, one kv head per tp rank)
    split over tp = 2, with and without activation checkpointing, against single-process
    AdamW on the unsplit model (= tp 1): same weights at the start (its slices), losses,
    norms and final weights within the GPT's bounds."""
    assert result["tp"] == 2 and result["world"] == n
    _check(result, stages=tuple(int(s) for s in stages.split(",")), gpt=False)
