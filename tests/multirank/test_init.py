"""zerompi.Init on the models users bring (issue 13, point 4): bitwise the weights of a
plain build under the same seed, for every zoo model, the reference GPT and Llama and common.py's
models, whatever way they initialise (nn.init imported by name, in-place methods,
padding_idx, transformers' _init_weights, deep-copied layers, load_state_dict); at most
`keep_full` full parameters at a time; engines take the model over; and wrong uses
raise errors naming the parameter and zerompi instead of crashing."""
import pytest

from batch import batched, worker
from mpirun import WORKERS, run_mpi

pytest.importorskip("transformers")
KEEP = 4  # tests/workers/init_models.py


@batched(lambda n: worker(n, "init_models", "--mode", "bitwise", timeout=300))
@pytest.mark.parametrize("n", [2, 3])
def test_init_is_bitwise_a_plain_build_for_every_model(result, n):
    r = result
    models = [k for k, v in r.items() if isinstance(v, dict)]
    assert len(models) == 14, models
    for kind in models:
        d = r[kind]
        assert d["diff"] == [], (kind, d["diff"])           # every weight, bitwise
        assert d["same_rng"], kind                          # and the same random numbers drawn
        assert d["full_bytes"] == 0 and d["still"], kind    # nothing full after the block
        assert d["plain_after_adopt"], kind
        # each rank keeps ~1/N (pieces padded to a multiple of N per parameter)
        assert d["pieces"] <= d["psi"] / n + n * d["nparams"], (kind, d)
        # never the whole model: at most KEEP full parameters at any moment
        assert d["peak_full"] <= KEEP and d["peak_elements"] <= d["largest"] < d["psi"], (kind, d)
    for kind in ("gpt", "hf-gpt2", "odd"):
        assert r[f"load-{kind}"], kind                       # load_state_dict inside Init
        assert r[f"engine1-{kind}"] == [] and r[f"engine3-{kind}"] == [], kind


@batched(lambda: worker(2, "init_models", "--mode", "errors"))
def test_wrong_uses_name_the_parameter(result):
    r = result
    name = "'enc.layers.1.self_attn.out_proj.weight'"  # a deep copy inside TransformerEncoder
    for key, op in (("inplace", "normal_"), ("forward", "embedding"), ("state_dict", "detach")):
        assert r[key].startswith("RuntimeError: zerompi.Init: parameter"), r[key]
        assert f"`{op}`" in r[key] and "GatheredParameters" in r[key], r[key]
    assert name in r["inplace"] and "partitioned over 2 ranks" in r["inplace"]
    assert name in r["repr"] and "partitioned" in r["repr"]
    assert r["meta_ok"] == [[32, 32], 1024, "torch.float32", True, 2]
    assert r["cpu_ok"]
    assert "zerompi.Init" in r["lazy"] and "LazyLinear" in r["lazy"] and "'weight'" in r["lazy"]
    assert "ranks built the model differently" in r["diverge"], r["diverge"]
    assert "rank 1: `fill_` on parameter 'blocks.0.child.bias'" in r["diverge"], r["diverge"]
    assert r["nested_ok"]
    assert r["cat_ok"]  # an op on several partitioned parameters at keep_full=1
    assert r["modified"] == [True, True]  # GatheredParameters(modifier_rank=0) in and after Init


def test_a_rank_gathering_alone_fails_named_not_hangs():
    r = run_mpi(2, [str(WORKERS / "init_models.py"), "--out", "/dev/null", "--mode", "stuck"],
                timeout=60, check=False)
    assert r.returncode != 0
    assert "zerompi.Init: gathering parameter 'blocks.0.child.weight'" in r.stdout, r.stdout[-3000:]
    assert r.elapsed < 20
