"""ZeRO-R activation checkpointing (zerompi/parallel/activations.py, ckpt_store.py;
docs/activation-checkpointing.md) in the engine on 2 ranks; config and the arena in one
process: tests/unit/test_activations.py.

The recomputation repeats the forward's exact operations (dropout included: the RNG
state is restored), gradients accumulate in the same order, and Pa's all-gather only
moves bits, so every variant must reproduce the run without checkpointing bit for bit:
the tests assert exact equality of losses and parameters at every stage."""
from batch import batched, worker

VARIANTS = ("plain", "pa", "pa_cpu", "pa_cpu_contig", "contig")
# tiny GPT: micro-batch of rows / gas / dp rows x seq 16 x n_embd 64, fp32, 2 blocks
ROWS, GAS, SEQ, EMBD, LAYERS = 8, 2, 16, 64, 2


def _check_engine(r, tp):
    per_block = ROWS // GAS // r["dp"] * SEQ * EMBD  # elements of one block input
    half = -(-per_block // tp)
    for stage in (0, 1, 2, 3):
        for v in VARIANTS:
            d = r[f"stage{stage}/{v}"]
            tag = (stage, v)
            assert d["losses"] == d["ref_losses"], tag          # bit for bit
            assert d["max_diff"] == 0.0, tag
            if stage == 3:
                assert d["materialized"] == [], tag
            pa = tp > 1 and v.startswith("pa")
            kept = LAYERS * (half if pa else per_block) * 4     # bytes at the peak, per rank
            for p in d["per_rank"]:
                s = p["stats"]
                assert s["blocks"] == LAYERS and s["partitioned"] == pa, tag
                assert s["kept_device"] == 0 and s["kept_host"] == 0, tag  # all consumed
                assert s["checkpoints"] == s["recomputed"] == 3 * GAS * LAYERS, tag
                host = "cpu" in v
                assert (s["peak_device"], s["peak_host"]) == ((0, kept) if host else (kept, 0)), tag
                arena = s["arena_host" if host else "arena_device"]
                assert (arena >= kept) if "contig" in v else arena == 0, tag
                assert s["arena_grown"] == 0, tag
                assert p["mem"]["activation_ckpt_host" if host else "activation_ckpt_device"] == max(kept, arena)
                assert p["mem"]["activation_ckpt_device" if host else "activation_ckpt_host"] == 0
            # Pa's all-gather volume per step (output elements), also in the tp comm stats
            gathered = GAS * LAYERS * half * tp if pa else 0
            assert d["gather_per_step"] == [gathered] * 3, tag
            assert d["tp_all_gather"] == 3 * gathered, tag


@batched(lambda: worker(2, "activation_ckpt", "--tp", "2", timeout=400))
def test_engine_tp2_pa_partitions_over_tp(result):
    """N = 2 as dp 1 x tp 2 (ParallelDims.create(tp_size=2) passed as dims=): the
    replicated block inputs are split over the tp pair - each rank keeps half - and
    all-gathered for the recomputation; stages 0-3, every variant, 3 steps."""
    r = result
    assert (r["tp"], r["dp"]) == (2, 1)
    _check_engine(r, tp=2)


@batched(lambda: worker(2, "activation_ckpt", "--tp", "1", timeout=400))
def test_engine_tp1_data_parallel(result):
    """N = 2 as dp 2 x tp 1: partition is a no-op (nothing split, nothing gathered),
    offload and the arena still apply; stages 0-3 reproduce the plain run exactly."""
    r = result
    assert (r["tp"], r["dp"]) == (1, 2)
    _check_engine(r, tp=1)


@batched(lambda: worker(2, "activation_ckpt", "--tp", "1", "--stages", "3", "--coalesce", "1000000",
                                    "--variants", "plain,contig", timeout=400))
def test_stage3_coalesced_units_with_checkpointing(result):
    """Stage 3 with the tiny GPT's model unit and both layers coalesced into one unit of
    three roots (stage3.coalesce_elements), every checkpointing variant: recomputation in
    backward runs the layers' forward again inside the held unit; bit for bit the plain
    run with one unit per layer, nothing left gathered."""
    r = result
    for v in ("plain", "contig"):
        d = r[f"stage3/{v}"]
        assert d["units"] == ["h.0+h.1+<root>"], d["units"]
        assert d["losses"] == d["ref_losses"] and d["max_diff"] == 0.0, v
        assert d["materialized"] == [], v


@batched(lambda: worker(2, "activation_ckpt", "--tp", "2", "--direct"))
def test_direct_blocks_with_extra_args_and_padding(result):
    """activations.apply on blocks taking (x, flag, scale=tensor) and returning (h, dict),
    block input of 455 elements (odd: tp 2 pads one), dropout in the block, two passes
    (the second reuses the arena): gradients of parameters, input and the keyword tensor
    equal the plain run's; kept bytes per rank are ceil(455 / 2) x 4 per block."""
    r = result
    n, blocks = 455, 3
    for v in VARIANTS:
        d = r[v]
        assert d["loss_diff"] == 0.0 and d["grad_diff"] == 0.0, v
        pa = v.startswith("pa")
        kept = blocks * ((n + 1) // 2 if pa else n) * 4
        for p in d["per_rank"]:
            mid, end = p["mid"], p["end"]  # after the second forward / after its backward
            where = "kept_host" if "cpu" in v else "kept_device"
            other = "kept_device" if "cpu" in v else "kept_host"
            assert mid[where] == kept and mid[other] == 0, v
            assert end["kept_device"] == end["kept_host"] == 0, v
            assert end["gather_elements"] == (2 * blocks * (n + 1) if pa else 0), v
            assert end["arena_grown"] == 0
        assert d["tp_all_gather"] == (2 * blocks * (n + 1) if pa else 0), v
