"""The estimator (zerompi/estimate, issue 17) in one process, no MPI.

- Table 1 of the paper, to its printed precision, from our formulas.
- The dry run lays out the engine's own partition (FlatLayout, the stage's plan) at N
  virtual ranks; its per-rank bytes (a ShardState on the meta device) equal the formula
  at the padded T for the 135M reference GPT and a 7.5B layout at N = 1, 3, 64, 1024,
  4096, and its per-rank real-element counts equal a brute-force count.
- At N = 1 the real engine's memory_report() and comm_stats() equal the dry run's, and
  the engine resolves bucket_size with the same element size as the dry run.
- With tp > 1 it lays out one tp rank's share of the GPT (at tp 2 and 4 equal to real tp
  engines' memory_report(): tests/multirank/test_tp_parity.py), and a config's
  zero.tensor_parallel_size is the tp it sizes.
The command line (`python -m zerompi.estimate`), including bucket_size "auto" at N = 4096
(every collective's per-rank chunk >= 256 KiB): tests/system/test_estimate_cli.py.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from mpirun import ROOT
from paper import PAPER_TABLE1
from zerompi.config import ZeroConfig
from zerompi.estimate import activations, memory, models
from zerompi.estimate.dryrun import DryRun, collectives, dry_run, padding_per_rank
from zerompi.zero.partition import FlatLayout


def test_table1_equals_the_paper():
    rows = memory.table1()
    assert len(rows) == 18
    for r in rows:
        assert (r["P_os"], r["P_os+g"], r["P_os+g+p"]) == PAPER_TABLE1[r["N"]][r["model"]], r


def test_paper_rounding():
    assert [memory.paper_round(x) for x in (41.25, 1.875, 0.46875, 0.1171875, 513.5, 2218.75, 7.5, 32, 62.5)] \
        == ["41.3", "1.88", "0.47", "0.12", "513", "2218", "7.5", "32", "62.5"]


def _expected(stage, precision, gdt, T, N):
    """tests/multirank/test_accounting.py's expected(), restated (that module needs MPI helpers)."""
    p = 4 if precision == "fp32" else 2
    g = 4 if (gdt == "fp32" or precision == "fp32") else 2
    k = 8 if precision == "fp32" else 12
    return [(p + g + k) * T, p * T + g * T + k * T // N, p * T + (g + k) * T // N, (p + g + k) * T // N][stage]


@pytest.mark.parametrize("precision,gdt", [("fp32", "param"), ("bf16", "param"), ("fp16", "param"),
                                           ("bf16", "fp32")])
def test_formulas_equal_the_engine_accounting(precision, gdt):
    for stage in range(4):
        for N in (1, 2, 3, 64):
            T = 96 * 64 * 7
            assert memory.model_states(T, N, stage, precision, gdt)["model_states"] == \
                _expected(stage, precision, gdt, T, N)
    assert memory.formula(2) == "2Ψ + 14Ψ/N" and memory.formula(1, "fp32") == "8Ψ + 8Ψ/N"
    assert memory.model_states(8e9, 4, 3, "bf16", tp=2)["model_states"] == 16 * 4e9 / 4


def test_model_shapes():
    assert models.from_preset("gpt-135m").psi == 135_654_144
    assert models.from_preset("gpt-7.5b").psi == 7_464_116_224
    assert models.from_preset("gpt-1t").psi == 1_008_015_820_800


@pytest.fixture(scope="module")
def runners():
    return {name: DryRun(models.from_preset(name), ZeroConfig(precision="bf16"))
            for name in ("gpt-135m", "gpt-7.5b")}


@pytest.mark.parametrize("name", ["gpt-135m", "gpt-7.5b"])
@pytest.mark.parametrize("n", [1, 3, 64, 1024, 4096])
def test_dry_run_bytes_equal_the_formula(runners, name, n):
    runner = runners[name]
    psi = runner.spec.psi
    for stage in (0, 1, 2, 3):
        for precision, gdt in (("bf16", "param"), ("fp32", "param"), ("bf16", "fp32")):
            d = dry_run(runner, n, stage, precision, gdt)
            T = d["padded"]
            assert d["equal_formula"], d["memory_report"]
            for rank, rep in d["memory_report"].items():  # ranks 0 and N-1, as ShardState counts
                assert rep["model_states"] == _expected(stage, precision, gdt, T, n), (stage, rank)
            units = d["units"]  # this run's layout ("auto" depends on the precision)
            assert 0 <= T - psi < units * n * 16 and T % n == 0
            bal = d["real_elements"]
            assert bal["padding_total"] == T - psi and bal["max"] <= T // n
            assert set(bal["checked_ranks"]) >= {"0", str(n - 1)}
        # the fixed 4M bucket (the default before "auto"): other blocks, same bytes at its T
        d = dry_run(runner, n, stage, "bf16", "param", bucket=1 << 22)
        assert d["equal_formula"], (stage, d["memory_report"])
        assert all(r["model_states"] == _expected(stage, "bf16", "param", d["padded"], n)
                   for r in d["memory_report"].values())


def test_padding_per_rank_equals_brute_force():
    """The gap walk against layout.owned_pieces at every rank, on odd shapes and units."""
    numels = [5, 0, 37, 1, 1000, 3, 64, 999, 17]
    for world in (1, 2, 3, 7, 16):
        for units in (None, [2, 3, 1, 3], [9]):
            for block in (16, 100, 5000):
                layout = FlatLayout(numels, world, block, align=4, units=units)
                pad = padding_per_rank(layout)
                real = [sum(p.size for p, _ in layout.owned_pieces(r)) for r in range(world)]
                assert list(layout.shard_size - pad) == real, (world, units, block)


def test_collectives_follow_the_accounting_convention(runners):
    """Elements per step as comm_stats() counts them (test_accounting.py): stage 0 2T,
    stages 1-2 T + T (stage 2 reduce-scatters every micro-step), stage 3 T + 2T (each unit
    is gathered by its root module once in forward, once in backward); plus the step's
    scalars. None at all on one rank."""
    runner = runners["gpt-135m"]
    for n in (1, 64):
        for gas in (1, 3):
            for stage in range(4):
                built = runner.build(n, stage)
                T, P = built.layout.total, len(built.numels)
                got = {}
                for r in collectives(built, stage, runner.zcfg, "bf16", gas):
                    got[r["op"]] = got.get(r["op"], 0) + r["counted_elements"]
                scalars = 2 * (1 + P)
                if n == 1:  # alone: nothing to reduce, gather or agree on
                    want = {}
                elif stage == 0:
                    want = {"all_reduce": 2 * T + scalars}
                elif stage < 3:
                    want = {"reduce_scatter": (gas if stage == 2 else 1) * T, "all_gather": T,
                            "all_reduce": scalars}
                else:
                    want = {"reduce_scatter": gas * T, "all_gather": gas * 2 * T, "all_reduce": scalars}
                assert got == want, (n, gas, stage)


def test_dry_run_of_a_1t_layout_is_fast():
    t = time.perf_counter()
    # a fixed 4M bucket: the most blocks (the heaviest layout); "auto" would need fewer
    runner = DryRun(models.from_preset("gpt-1t"), ZeroConfig(precision="bf16", bucket_size=1 << 22))
    runs = [dry_run(runner, 4096, s) for s in (0, 1, 2, 3)]
    took = time.perf_counter() - t
    print(f"\n1T-parameter dry run, N = 4096, stages 0-3: {took:.1f} s "
          f"(layouts {sum(r['layout_seconds'] for r in runs[::3]):.2f} s)")
    assert all(r["equal_formula"] for r in runs)
    assert runs[1]["blocks"] > 200_000
    assert took < 60


def test_activations_formula():
    spec = models.from_preset("gpt-7.5b")
    g, s = spec.gpt, spec.seq
    a = activations.activation_bytes(spec, 2, "bf16")
    layer = s * 2 * g.n_embd * (34 + 5 * g.n_head * s / g.n_embd)
    head = s * 2 * g.vocab_size * 10
    assert a["none"]["device"] == pytest.approx(g.n_layer * layer + head, rel=1e-12)
    assert a["checkpoint"]["device"] == pytest.approx(g.n_layer * 2 * s * 2 * g.n_embd + layer + head, rel=1e-12)
    assert a["checkpoint+Pa"] == a["checkpoint"]  # tp = 1: nothing to partition
    off = a["checkpoint+Pa+offload"]
    assert off["device"] < a["checkpoint"]["device"] and off["host"] == g.n_layer * 2 * s * 2 * g.n_embd
    a32 = activations.activation_bytes(spec, 2, "fp32")
    assert a32["none"]["device"] > 1.9 * a["none"]["device"] - head
    assert activations.activation_bytes(models.from_params(1e9), 1) is None
    # at tp 4 a rank's logits span its share of the vocabulary padded to 128 x 4 (50304 is 98.25 x 512)
    a4 = activations.activation_bytes(spec, 2, "bf16", tp=4)
    layer4 = s * 2 * g.n_embd * (10 + 24 / 4 + 5 * g.n_head * s / (g.n_embd * 4))
    assert a4["none"]["device"] == pytest.approx(g.n_layer * layer4 + s * 2 * 50688 / 4 * 10, rel=1e-12)
    assert activations.largest_micro_batch(100, 40, 7) == 8 and activations.largest_micro_batch(10, 40, 7) == 0


def test_units():
    assert memory.parse_bytes("80GiB") == 80 * 2**30 and memory.parse_bytes("40 GB") == 40 * 10**9
    assert memory.parse_bytes("2e9") == 2 * 10**9
    assert memory.parse_count("4M") == 1 << 22 and memory.parse_count("65536") == 65536
    for bad in ("", "GB", "-1GB", "3 furlongs"):
        with pytest.raises(ValueError):
            memory.parse_bytes(bad)


# ---------------------------------------------------------------------- the real engine at N = 1
def test_dry_run_equals_the_engine_at_n1():
    """memory_report() (every term, the padded T, the bucket buffers, stage 3's gather
    pool) and comm_stats() (calls, elements and bytes per op over a GAS-2 step) of the real engine, single
    process, stages 0-3, fp32/bf16/fp32-gradients, against the dry run of the same GPT;
    plus stages 2-3 with the layout "auto" makes at large N forced (blocks of at least the
    bucket, stage-3 units coalesced): the same blocks and units in both."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, str(ROOT / "tests" / "workers" / "estimate_engine.py")],
                       capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    cases = json.loads(p.stdout)
    assert len(cases) == 14
    for c in cases:
        assert c["engine_units"] == c["estimate_units"] and c["engine_blocks"] == c["estimate_blocks"], c
        if c["forced"]:  # blocks of at least 60,000; stage 3: the model's unit took in h.0
            assert all(e - s >= 60_000 for s, e in c["engine_blocks"]) or c["stage"] == 3, c
            if c["stage"] == 3:
                assert c["engine_units"] == ["h.1", "h.0+<root>"], c["engine_units"]
        tag = (c["stage"], c["precision"], c["gdt"])
        for k in ("params", "grads", "master", "optimizer", "model_states"):
            assert c["engine"][k] == c["estimate"][k], (tag, k)
        assert c["engine_padded"] == c["estimate_padded"], tag
        assert c["engine_buffers"] == c["estimate_buffers"], tag
        assert c["engine_gather_pool"] == c["estimate_gathered"], tag  # stage 3's pool; else 0
        assert c["engine_comm"] == c["estimate_comm"], tag
        # the engine resolves bucket_size with the run's element size, as the dry run does
        assert c["engine_policy_calls"] == c["estimate_policy_calls"] != [], tag
        # (stage 0 has no parameter all-gather: its all-reduce moves the fp32 reduce dtype)
        assert c["engine_policy_calls"][0][2] == {
            "elem_bytes": 4 if c["precision"] == "fp32" or c["stage"] == 0 else 2, "device": "cpu"}, tag
    # ... which, at large N, is the dry run's "auto" bucket for a bf16 config
    from zerompi.zero.buckets import bucket_policy
    kw = next(c["engine_policy_calls"][0][2] for c in cases if c["precision"] == "bf16" and c["stage"] > 0)
    runner = DryRun(models.from_preset("tiny"), ZeroConfig(precision="bf16"))
    for n in (8, 64, 4096):
        assert bucket_policy("auto", n, **kw)[0] == runner.build(n, 2).bucket > 1 << 22, n


# ---------------------------------------------------------------------- tensor parallelism
def test_a_tp_layout_is_one_tp_ranks_share_of_the_gpt():
    """What parallelize() leaves on a tp rank, counted here from the GPT's shapes
    (Megatron's split: q/k/v, MLP and the padded vocabulary divided; LayerNorms,
    positions and the row-parallel biases whole), not by parallelize itself."""
    cfg = models.ALL_SHAPES["gpt2"]
    V, C, L, d = cfg.vocab_size, cfg.block_size, cfg.n_layer, cfg.n_embd
    for tp in (1, 2, 4):
        vocab = V if tp == 1 else -(-V // (128 * tp)) * 128 * tp
        block = (4 * d                                  # ln_1, ln_2: weight and bias
                 + (3 * d * d + 3 * d) // tp + d * d // tp + d  # c_attn (columns), c_proj (rows) + its bias
                 + (4 * d * d + 4 * d) // tp + 4 * d * d // tp + d)  # c_fc, c_proj + its bias
        want = vocab // tp * d + C * d + L * block + 2 * d  # wte (tied head), wpe, blocks, ln_f
        got = sum(p.numel() for _, p in DryRun(models.from_preset("gpt2"), tp=tp).trainable)
        assert got == want, (tp, got, want)
        if tp == 1:
            assert got == models.count_params(cfg)


def test_sizing_at_tp2_has_the_stage3_work_and_a_configs_tp_is_the_default(tmp_path):
    """A tp > 1 run keeps its layers (it used to be sized as a flat vector, its stage-3
    working memory unknown); a config's zero.tensor_parallel_size is taken when --tp is
    not given (it used to be sized at tp 1)."""
    from zerompi.estimate import api

    one, two = (api.size("gpt2", [8], [3], tp=tp)["runs"][0] for tp in (1, 2))
    assert two["work_estimated"] and 0 < two["gathered"] < one["gathered"]
    g = models.ALL_SHAPES["gpt2"]
    whole = g.block_size * g.n_embd + (6 * g.n_layer + 2) * g.n_embd  # wpe, LayerNorms, row biases
    assert one["params"] / 2 < two["params"] <= one["params"] / 2 + whole + 128 * g.n_embd  # + padding rows
    cfg = tmp_path / "tp2.toml"
    cfg.write_text('[model]\npreset = "gpt2"\n[zero]\nstage = 3\ntensor_parallel_size = 2\n')
    run = api.size(str(cfg), [8])["runs"][0]
    assert run["tp"] == 2 and run["params"] == two["params"]



def test_auto_bucket_floor_on_a_gpu():
    """A GPU's "auto" floor is 2^26 elements (each bucket's host cost is fixed), the CPU's
    2^22; above the floor both grow with N alike."""
    from zerompi.zero.buckets import AUTO_FLOOR_GPU, bucket_policy

    assert AUTO_FLOOR_GPU == 1 << 26
    for n in (1, 2, 8, 64):
        assert bucket_policy("auto", n, elem_bytes=2, device="cuda") == (1 << 26, False), n
        assert bucket_policy("auto", n, elem_bytes=2)[0] == max(1 << 22, n * 562_512), n
    big = bucket_policy("auto", 256, elem_bytes=2)
    assert big == bucket_policy("auto", 256, elem_bytes=2, device="cuda") and big[1] and big[0] > 1 << 26
    assert bucket_policy(1000, 4, elem_bytes=2, device="cuda") == (1000, False)  # an integer is kept


def test_meta_models_leave_torch_dynamo_unimported():
    """Building the estimator's models on `meta` sets no values: without on_meta, the
    init's normal_ there imports torch._dynamo, seconds of CPU in every estimate command."""
    code = ("import sys, torch\n"
            "from zerompi.estimate import models\n"
            "normal_ = torch.nn.init.normal_\n"
            "m = models.meta_model(models.from_preset('gpt2'))\n"
            "assert next(m.parameters()).is_meta and torch.nn.init.normal_ is normal_\n"
            "print('torch._dynamo' in sys.modules)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stdout + r.stderr
