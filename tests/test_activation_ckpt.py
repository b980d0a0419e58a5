"""ZeRO-R activation checkpointing (zerompi/parallel/activations.py, ckpt_store.py;
docs/activation-checkpointing.md).

The recomputation repeats the forward's exact operations (dropout included: the RNG
state is restored), gradients accumulate in the same order, and Pa's all-gather only
moves bits, so every variant must reproduce the run without checkpointing bit for bit:
the tests assert exact equality of losses and parameters at every stage."""
import tomllib

import pytest

import zerompi
from mpirun import run_worker
from zerompi.config import ConfigError, load
from zerompi.config.deepspeed import translate

VARIANTS = ("plain", "pa", "pa_cpu", "pa_cpu_contig", "contig")
# tiny GPT: micro-batch of rows / gas / dp rows x seq 16 x n_embd 64, fp32, 2 blocks
ROWS, GAS, SEQ, EMBD, LAYERS = 8, 2, 16, 64, 2


def test_config_validates_and_loads_from_toml_and_overrides():
    cfg = load(tomllib.loads("stage = 2\n[activation_checkpointing]\nenabled = true\npartition = true\n"
                             "cpu_offload = true\ncontiguous = true\n"))
    ac = cfg.activation_checkpointing
    assert (ac.enabled, ac.partition, ac.cpu_offload, ac.contiguous) == (True, True, True, True)
    assert not load({}).activation_checkpointing.enabled
    assert load(None, ["activation_checkpointing.enabled=true"]).activation_checkpointing.enabled
    for key in ("partition", "cpu_offload", "contiguous"):
        with pytest.raises(ConfigError) as e:
            load({"activation_checkpointing": {key: True}})
        assert e.value.key == f"activation_checkpointing.{key}"
    with pytest.raises(ConfigError) as e:
        load({"activation_checkpointing": {"partition_activation": True, "enabled": True}})
    assert e.value.key == "activation_checkpointing.partition_activation"
    from zerompi.config.train import TrainConfig

    tc = load({"zero": {"activation_checkpointing": {"enabled": True}}}, ["zero.activation_checkpointing.partition=1"],
              cls=TrainConfig)
    assert tc.zero.activation_checkpointing.partition
    with pytest.raises(ConfigError) as e:
        load({"zero": {"activation_checkpointing": {"cpu_offload": True}}}, cls=TrainConfig)
    assert e.value.key == "zero.activation_checkpointing.cpu_offload"


def test_deepspeed_activation_checkpointing_maps_onto_ours():
    t = translate({"activation_checkpointing": {
        "partition_activations": True, "cpu_checkpointing": True, "contiguous_memory_optimization": False,
        "number_checkpoints": 4, "synchronize_checkpoint_boundary": False}}, world_size=1)
    assert t.zero["activation_checkpointing"] == {"enabled": True, "partition": True, "cpu_offload": True,
                                                  "contiguous": False}
    assert t.ignored == ["activation_checkpointing.number_checkpoints"]
    t = translate({"activation_checkpointing": {"partition_activations": False}}, world_size=1)
    assert "activation_checkpointing" not in t.zero and t.ignored == []
    # our own table is not mistaken for a DeepSpeed config
    assert zerompi.load_config({"activation_checkpointing": {"enabled": True}}).activation_checkpointing.enabled


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


def test_engine_tp2_pa_partitions_over_tp(tmp_path):
    """N = 2 as dp 1 x tp 2 (ParallelDims.create(tp_size=2) passed as dims=): the
    replicated block inputs are split over the tp pair - each rank keeps half - and
    all-gathered for the recomputation; stages 0-3, every variant, 3 steps."""
    r = run_worker(2, "activation_ckpt", ["--tp", "2"], tmp_path, timeout=400)
    assert (r["tp"], r["dp"]) == (2, 1)
    _check_engine(r, tp=2)


def test_engine_tp1_data_parallel(tmp_path):
    """N = 2 as dp 2 x tp 1: partition is a no-op (nothing split, nothing gathered),
    offload and the arena still apply; stages 0-3 reproduce the plain run exactly."""
    r = run_worker(2, "activation_ckpt", ["--tp", "1"], tmp_path, timeout=400)
    assert (r["tp"], r["dp"]) == (1, 2)
    _check_engine(r, tp=1)


def test_stage3_coalesced_units_with_checkpointing(tmp_path):
    """Stage 3 with the tiny GPT's model unit and both layers coalesced into one unit of
    three roots (stage3.coalesce_elements), every checkpointing variant: recomputation in
    backward runs the layers' forward again inside the held unit; bit for bit the plain
    run with one unit per layer, nothing left gathered."""
    r = run_worker(2, "activation_ckpt", ["--tp", "1", "--stages", "3", "--coalesce", "1000000",
                                          "--variants", "plain,contig"], tmp_path, timeout=400)
    for v in ("plain", "contig"):
        d = r[f"stage3/{v}"]
        assert d["units"] == ["h.0+h.1+<root>"], d["units"]
        assert d["losses"] == d["ref_losses"] and d["max_diff"] == 0.0, v
        assert d["materialized"] == [], v


def test_direct_blocks_with_extra_args_and_padding(tmp_path):
    """activations.apply on blocks taking (x, flag, scale=tensor) and returning (h, dict),
    block input of 455 elements (odd: tp 2 pads one), dropout in the block, two passes
    (the second reuses the arena): gradients of parameters, input and the keyword tensor
    equal the plain run's; kept bytes per rank are ceil(455 / 2) x 4 per block."""
    r = run_worker(2, "activation_ckpt", ["--tp", "2", "--direct"], tmp_path)
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


def test_arena_grows_once_and_no_grad_runs_plainly(capfd):
    """Single process (a size-1 tp group needs no MPI): the arena is sized on the first
    pass (slots x first input), a longer sequence later grows it once (logged) and is
    then reused; offload puts the kept inputs in the host arena; under no_grad nothing
    is kept; remove() restores the blocks' own forward."""
    import types

    import torch
    import torch.nn as nn

    from zerompi.device import Placement
    from zerompi.parallel import activations

    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.GELU()) for _ in range(3)])
    plain = [p.detach().clone() for p in net.parameters()]
    cfg = load({"activation_checkpointing": {"enabled": True, "cpu_offload": True, "contiguous": True}})
    acts = activations.apply(net, cfg.activation_checkpointing, types.SimpleNamespace(size=1, rank=0), Placement())
    assert [n for n, _ in acts.blocks] == ["0", "1", "2"]
    for seq in (4, 4, 20, 20):
        x = torch.randn(seq, 8, requires_grad=True)
        net(x).sum().backward()
        s = acts.stats()
        assert s["peak_host"] >= 3 * seq * 8 * 4 and s["peak_device"] == 0 and s["kept_host"] == 0
    assert s["arena_grown"] == 1 and s["arena_host"] >= 3 * 20 * 8 * 4
    assert "grows" in capfd.readouterr().err
    with torch.no_grad():
        net(torch.randn(4, 8))
    assert acts.stats()["checkpoints"] == s["checkpoints"]
    # gradients equal those of the unwrapped module
    x = torch.randn(5, 8, requires_grad=True)
    net.zero_grad()
    net(x).sum().backward()
    g1 = [p.grad.clone() for p in net.parameters()] + [x.grad.clone()]
    acts.remove()
    assert all("forward" not in m.__dict__ for m in net)
    x.grad = None
    net.zero_grad()
    net(x).sum().backward()
    g0 = [p.grad.clone() for p in net.parameters()] + [x.grad.clone()]
    assert all(torch.equal(a, b) for a, b in zip(g0, g1))
    assert all(torch.equal(a, b) for a, b in zip(plain, net.parameters()))
