"""The hierarchy's single-process parts: config keys and their errors, the DeepSpeed
keys, the group decisions (zero/groups.py decide), the replicated layout and the chain
ordering (comm/chain.py). The estimator's bytes inside and across nodes for every mode:
tests/unit/test_multinode_estimate.py."""
from __future__ import annotations

import pytest

from zerompi.config import ConfigError, load
from zerompi.config.deepspeed import translate
from zerompi.zero.groups import decide
from zerompi.zero.partition import FlatLayout


@pytest.mark.parametrize("data,key", [
    ({"shard_group": 0}, "shard_group"), ({"shard_group": "rack"}, "shard_group"),
    ({"stage3": {"secondary_partition": "rack"}}, "stage3.secondary_partition"),
    ({"stage3": {"secondary_partition": 0}}, "stage3.secondary_partition"),
    ({"comm": {"hierarchical": "yes"}}, "comm.hierarchical"),
    ({"shard_group": "node", "comm": {"hierarchical": "on"}}, "comm.hierarchical")])
def test_bad_values_name_the_key(data, key):
    with pytest.raises(ConfigError) as e:
        load(data)
    assert e.value.key == key, str(e.value)
    cfg = load(None, overrides=["shard_group=4", "stage3.secondary_partition=node", "comm.hierarchical=off"])
    assert (cfg.shard_group, cfg.stage3.secondary_partition, cfg.comm.hierarchical) == (4, "node", "off")


def test_deepspeed_hpz_and_mics():
    z = lambda **kw: {"zero_optimization": {"stage": 3, **kw}}  # noqa: E731
    t = translate(z(zero_hpz_partition_size=8, mics_shard_size=16), world_size=64)
    assert t.zero["stage3"]["secondary_partition"] == 8 and t.zero["shard_group"] == 16 and not t.ignored
    t = translate(z(zero_hpz_partition_size=1, mics_shard_size=-1), world_size=64)
    assert "shard_group" not in t.zero and "secondary_partition" not in t.zero.get("stage3", {})
    with pytest.raises(ConfigError) as e:  # DeepSpeed shards over the world below stage 3
        translate({"zero_optimization": {"stage": 2, "mics_shard_size": 8}}, world_size=64)
    assert e.value.key == "zero_optimization.mics_shard_size"
    with pytest.raises(ConfigError) as e:
        translate(z(zero_hpz_partition_size=0), world_size=64)
    assert e.value.key == "zero_optimization.zero_hpz_partition_size"


def _nodes(n, p):
    return [r // p for r in range(n)]


def test_group_decisions():
    d = lambda n, p, sg="world", h="auto", sec="off", stage=3: decide(_nodes(n, p), sg, h, sec, stage)  # noqa: E731
    assert (d(8, 2).mode, d(8, 2).k) == ("two-level", 8)             # auto: spans nodes, several per node
    assert d(8, 8).mode == "flat" and d(8, 1).mode == "flat"          # one node; one rank per node
    assert d(8, 2, h="off").mode == "flat" and d(8, 8, h="on").mode == "two-level"
    assert (d(8, 2, "node").mode, d(8, 2, "node").k, d(8, 2, "node").g) == ("hybrid", 2, 4)
    assert (d(8, 2, 4).k, d(8, 2, 1).g) == (4, 8)
    assert d(8, 2, sec="node").secondary == 2 and d(8, 2, 4, sec="node").secondary == 2
    assert d(8, 2, "node", sec="node").secondary == 0   # the shards are node-local already
    assert d(8, 2, sec="node", stage=2).secondary == 0  # stage 3 only
    assert d(8, 2, stage=0).mode == "flat"              # stage 0 partitions nothing
    for kw, key in [({"sg": 3}, "shard_group"), ({"sec": 3}, "stage3.secondary_partition"),
                    ({"sg": 2, "sec": 4}, "stage3.secondary_partition"),
                    ({"sg": 4, "sec": 8}, "stage3.secondary_partition")]:
        with pytest.raises(ConfigError) as e:
            d(8, 2, **kw)
        assert e.value.key == key, kw
    with pytest.raises(ConfigError) as e:  # groups of 3 straddle shard groups of 6
        decide(_nodes(12, 2), 6, "auto", 4, 3)
    assert e.value.key == "stage3.secondary_partition"
    uneven = [0, 0, 0, 1, 1, 1, 2, 2]
    with pytest.raises(ConfigError) as e:
        decide(uneven, "node", "auto", "off", 2)
    assert e.value.key == "shard_group"
    assert decide(uneven, "world", "auto", "off", 2).mode == "flat"
    with pytest.raises(ConfigError):
        decide(uneven, "world", "on", "off", 2)


def test_replicated_layout_splits_every_chunk_over_the_replicas():
    """K = 2 ranks per group, G = 3 groups: blocks are those of the flat layout over 6."""
    sizes = [37, 5, 300, 1, 64, 999]
    flat = FlatLayout(sizes, 6, 100, 16)
    hyb = FlatLayout(sizes, 2, 100, 16, replicas=3)
    assert hyb.blocks == flat.blocks and hyb.total == flat.total
    assert all(hyb.chunk_size(k) % (3 * 16) == 0 for k in range(len(hyb.blocks)))
    assert hyb.shard_size == 3 * flat.shard_size


class _Req:
    def __init__(self, log, name):
        self.log, self.name, self.ready = log, name, False

    def test(self):
        return self.ready

    def wait(self, timeout=None):
        self.log.append(("done", self.name))


class _Comm:
    pass


def test_chains_start_steps_in_creation_order_on_each_communicator():
    """A later chain whose first step finishes first must not start its step on a
    shared communicator before an earlier chain's: every rank issues the same order."""
    from zerompi.comm.base import ACTIVE_CHAINS, CommStats
    from zerompi.comm.chain import Chain, Step

    log, reqs = [], {}
    a_comm, b_comm, shared = _Comm(), _Comm(), _Comm()

    def start(name):
        def go():
            log.append(("start", name))
            reqs[name] = _Req(log, name)
            return reqs[name]
        return go

    x = Chain(CommStats(), "x", [Step(a_comm, start("x1")), Step(shared, start("x2"))])
    y = Chain(CommStats(), "y", [Step(b_comm, start("y1")), Step(shared, start("y2"))])
    reqs["y1"].ready = True
    y.test()
    assert ("start", "y2") not in log  # x2 is first in the shared queue
    reqs["x1"].ready = True
    x.test()
    assert log.index(("start", "x2")) < log.index(("start", "y2"))
    reqs["x2"].ready = reqs["y2"].ready = True
    x.wait()
    y.wait()
    assert x.done and y.done and not ACTIVE_CHAINS
