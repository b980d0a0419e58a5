"""torch.compile as users apply it, at N = 2 (tests/workers/compile_modes.py): per block
(`block.compile()`, torchtitan's way) at every stage, the whole model (`torch.compile(model)`)
at stages 2-3, and a whole model run once before `zerompi.initialize` at stage 3. Each
trains exactly as the same engine uncompiled (aot_eager: the same aten ops, so equality is
exact), runs compiled graphs, and compiles nothing after its first step: the engine's hooks
are graph breaks (zero/weak_hooks.py; traced, they recompiled at the second step) and no
graph traced without them runs (zero/compiled.py; one did and read released parameters)."""
import pytest

from mpirun import run_worker

CASES = ["block:0", "block:1", "block:2", "block:3", "whole:2", "whole:3", "warm:3"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_worker(2, "compile_modes", ["--backend", "aot_eager", "--cases", ",".join(CASES)],
                      tmp_path_factory.mktemp("compile"), timeout=420)


def check(r: dict) -> None:
    assert r["losses"] == r["eager_losses"] and r["val"] == r["eager_val"], r
    assert r["param_diff"] == 0.0 and r["same_names"], r
    assert r["calls"] > 0, r  # the compiled graphs ran (not a silent fallback to eager)
    assert r["graphs"][0] == r["graphs"][-1], f"recompiled after the first step: {r['graphs']}"


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_per_block_compile_trains_at_every_stage(runs, stage):
    check(runs[f"block:{stage}"])


@pytest.mark.parametrize("stage", [2, 3])  # stage 1: the same parameter store as 2
def test_whole_model_compile_trains(runs, stage):
    check(runs[f"whole:{stage}"])


def test_whole_model_compiled_and_run_before_initialize_trains_at_stage3(runs):
    """Its first graph spans the whole model; at stage 3 it would read released
    parameters ("data is not allocated yet")."""
    check(runs["warm:3"])
