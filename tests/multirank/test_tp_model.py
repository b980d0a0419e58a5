"""Tensor parallelism for the reference GPT (issue 15) on 1, 2 and 4 ranks: parallel/
tensor_parallel.py's layers and parallel/parallelize.py against the plain GPT built with
the same seed (in one process: tests/unit/test_tensor_parallel.py).

tests/workers/tp_model.py: at tp = 2 and 4 every local weight is its tp_layout slice of
the plain weight (bitwise), the loss and every local gradient match the plain model's,
replicated gradients agree across tp ranks, the padded vocabulary gets no gradient and
garbage in it changes nothing, and SGD steps follow the plain run; at tp = 1 all of it is
bitwise.
"""
import pytest

from batch import batched, worker
from zerompi.parallel.tensor_parallel import padded_vocab_size


def _check_rank(d, model, tp):
    vocab = 256 if model == "tiny" else 300
    assert d["weights_differ"] == [], d["weights_differ"]          # (a) tp-invariant init
    assert d["tied"] and d["nparams_same_set"]
    assert d["replicated_grads_agree"] and d["loss_agrees"]
    # (b) loss
    assert abs(d["loss_tp"] - d["loss_plain"]) <= 1e-6 * abs(d["loss_plain"]), d
    assert d["logits_rel"] <= 1e-6
    # (c) gradients: every local gradient is the slice of the plain gradient
    worst = max(d["grad_rel"], key=d["grad_rel"].get)
    assert d["grad_rel"][worst] <= 1e-5, (worst, d["grad_rel"][worst])
    # (d) padding: no gradient, garbage in it changes nothing, stays zero while training
    assert d["pad_grad_zero"] and d["padded_logits_zero"]
    assert d["garbage_loss_bitwise"] and d["garbage_pad_grad_zero"] and d["garbage_grads_bitwise"]
    assert d["pad_rows_after_training_zero"]
    assert d["train_tp"] == pytest.approx(d["train_plain"], rel=1e-5)
    assert d["weights_rel_after_training"] <= 1e-5
    padded = padded_vocab_size(vocab, tp)
    assert d["logits_width"] == (vocab if tp == 1 else padded // tp)
    pad_here = max(0, min(padded // tp, (d["tp_rank"] + 1) * padded // tp - vocab))
    assert d["pad_rows"] == pad_here
    # what is split, and how (tp_layout's contract); replicated parameters are unmarked
    s, t, c = d["split"], d["tp_rank"], 64
    assert s["wte.weight"] == [0, [vocab, c], t * padded // tp, 1]
    assert s["h.0.attn.c_attn.weight"] == [0, [3 * c, c], t * c // tp, 3]
    assert s["h.1.attn.c_proj.weight"] == [1, [c, c], t * c // tp, 1]
    assert s["h.0.mlp.c_fc.weight"] == [0, [4 * c, c], t * 4 * c // tp, 1]
    assert s["h.0.mlp.c_proj.weight"] == [1, [c, 4 * c], t * 4 * c // tp, 1]
    if model == "tiny":
        assert s["h.0.attn.c_attn.bias"] == [0, [3 * c], t * c // tp, 3]
        assert s["h.0.mlp.c_fc.bias"] == [0, [4 * c], t * 4 * c // tp, 1]
        assert s["h.0.mlp.c_proj.bias"] is None and s["h.0.attn.c_proj.bias"] is None
    for name in ("wpe.weight", "ln_f.weight", "h.0.ln_1.weight", "h.1.ln_2.weight"):
        assert s[name] is None, name
    if tp == 1:  # bitwise the plain model
        assert d["loss_bitwise"] and d["grads_bitwise"] and d["wte_grad_bitwise"]
        assert d["train_tp"] == d["train_plain"] and d["weights_rel_after_training"] == 0


@batched(lambda n, model: worker(n, "tp_model", "--tp", str(n), "--model", model, timeout=240))
@pytest.mark.parametrize("n,model", [(1, "tiny"), (1, "odd"), (2, "tiny"), (2, "odd"), (4, "odd")])
def test_parallel_gpt_equals_the_plain_gpt(n, model, result):
    res = result
    ranks = res["ranks"]
    assert [d["tp_rank"] for d in ranks] == list(range(n))
    for d in ranks:
        _check_rank(d, model, n)
    assert len({d["loss_tp"] for d in ranks}) == 1
