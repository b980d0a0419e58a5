"""ZeRO-R activation checkpointing in one process (zerompi/parallel/activations.py;
docs/activation-checkpointing.md): the config section and its DeepSpeed mapping, and the
activation arena on a size-1 group. The engine on 2 ranks: tests/multirank/test_activation_ckpt.py."""
import tomllib

import pytest

import zerompi
from zerompi.config import ConfigError, load
from zerompi.config.deepspeed import translate


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
    from zerompi.trainer.config import TrainConfig

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
