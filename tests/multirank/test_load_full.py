"""engine.load_full_state_dict (issue 13): pretrained transformers weights into a
stage-3 (and stage-1) engine, streamed from rank 0; clear key errors on every rank."""
import pytest

from batch import batched, worker

pytest.importorskip("transformers")


@batched(lambda: worker(2, "load_full", "--dir", "{dir}/gpt2", timeout=300))
def test_from_pretrained_gpt2_loads_into_stage3_and_stage1(result):
    r = result
    for run in ("3-fp32", "1-bf16", "3-bf16"):
        d = r[run]
        assert d["result"] == [[], []] and d["n"] == 28, (run, d)
        assert d["same"], run  # full_state_dict (fp32 master) == the pretrained weights, bitwise
    # the working parameters were refreshed too: the engine's logits are the pretrained model's
    assert r["3-fp32"]["logits_err"] < 1e-5, r["3-fp32"]
    assert r["1-bf16"]["logits_err"] < 0.05 and r["3-bf16"]["logits_err"] < 0.05, r
    a, b = r["errors_everywhere"]
    assert a == b  # every rank raised the same error (only rank 0 had the state dict)
    assert "missing key(s): transformer.h.1.mlp.c_fc.bias" in a["missing"], a
    assert "unexpected key(s): transformer.extra.weight" in a["unexpected"], a
    assert "key 'transformer.wpe.weight'" in a["shape"] and "(31, 32)" in a["shape"], a
    assert all(m.startswith("zerompi load_full_state_dict:") for k, m in a.items() if m)
    assert a["tied_one_name"] == ""  # the tied head's name alone loads the embedding
    assert r["init_from_pretrained"] == {"partitioned": True, "same": True}
    assert len(r["partial_missing"]) == 12 and all(".h.1." in k for k in r["partial_missing"])
