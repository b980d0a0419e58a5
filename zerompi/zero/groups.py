"""Where a run's states are partitioned and its collectives run, from the grid's nodes
and three keys (docs/architecture.md, "Hierarchy"):

  zero.shard_group          world | node | K   states partitioned over all N ranks, over
                                               each node's ranks, or over K consecutive
                                               ranks; replicated across the N/K groups
  zero.comm.hierarchical    auto | on | off    shard_group world only: reduce-scatter and
                                               all-gather in two levels (comm/hierarchy.py)
  zero.stage3.secondary_partition off|node|K   stage 3: backward re-gathers inside a small
                                               group (zero/stage3/secondary.py)

Modes (`GroupPlan.mode`):
  flat       shard = the data-parallel group itself (as before this module existed)
  two-level  shard = comm.hierarchy.TwoLevel over the same N ranks: shard index
             s = local * M + node instead of the dp rank (a node-major relabelling the
             checkpoint never sees: it stores by parameter name and range)
  hybrid     shard = a group of K ranks, replica = the G = N / K ranks holding the same
             shard; the reducer's reduce-scatter is comm.hierarchy.Replicated

`decide` is pure (the estimator's dry run calls it with a node map of its own); `build`
makes the communicators. Every input is the same on every rank (the config, checked
equal everywhere, and one allgather of node indices), so every rank builds the same
groups in the same order.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from ..config import ConfigError


@dataclass(frozen=True)
class GroupPlan:
    mode: str             # flat | two-level | hybrid
    n: int                # data-parallel ranks
    k: int                # ranks per shard group (the layout's world)
    nodes: int            # nodes the data-parallel group spans
    per_node: int         # its ranks per node (0: uneven)
    secondary: int = 0    # stage 3's secondary group size (0: off)
    by_node: bool = False  # shard groups are the nodes (shard_group "node")

    @property
    def g(self) -> int:
        return self.n // self.k


def decide(nodes: list[int], shard_group, hierarchical: str, secondary, stage: int) -> GroupPlan:
    """The plan for data-parallel ranks on `nodes` (node of each rank, numbered from 0 in
    order of appearance). Raises ConfigError naming the key that does not fit."""
    n = len(nodes)
    counts = Counter(nodes)
    m = len(counts)
    per = n // m if len(set(counts.values())) == 1 else 0
    if stage == 0:
        return GroupPlan("flat", n, n, m, per)  # nothing partitioned; the all-reduce stays flat
    sg = shard_group
    if sg == "node":
        if not per:
            raise ConfigError("shard_group", sg, f"the data-parallel group has different numbers of ranks "
                              f"on its {m} nodes; give a number of ranks per group instead")
        k = per
    else:
        k = n if sg == "world" else int(sg)
    if n % k:
        raise ConfigError("shard_group", sg, f"{k} ranks per group must divide the data-parallel size {n}")
    if k < n:
        plan = GroupPlan("hybrid", n, k, m, per, by_node=sg == "node")
    elif hierarchical == "off" or (hierarchical == "auto" and not (m > 1 and per > 1)):
        plan = GroupPlan("flat", n, n, m, per)
    elif not per:
        if hierarchical == "on":
            raise ConfigError("comm.hierarchical", hierarchical, f"the data-parallel group has different "
                              f"numbers of ranks on its {m} nodes (tensor_parallel_size must divide the ranks "
                              "per node)")
        plan = GroupPlan("flat", n, n, m, per)
    else:
        plan = GroupPlan("two-level", n, n, m, per)
    if stage == 3:
        plan = GroupPlan(plan.mode, n, k, m, per, _secondary(secondary, plan, nodes), plan.by_node)
    return plan


def _secondary(value, plan: GroupPlan, nodes: list[int]) -> int:
    """Size of the secondary groups: the node's data-parallel ranks, or K consecutive ones."""
    if value in ("off", 1):
        return 0
    n, k = plan.n, plan.k
    if value == "node":
        if not plan.per_node or plan.per_node >= k:
            return 0  # one node, or shards inside the node already: nothing to save
        size, member = plan.per_node, nodes
    else:
        size, member = int(value), [q // int(value) for q in range(n)]
        if n % size:
            raise ConfigError("stage3.secondary_partition", value, f"must divide the data-parallel size {n}")
        if size >= k:
            raise ConfigError("stage3.secondary_partition", value, f"a group of {size} ranks is not smaller than "
                              f"the shard group ({k}): backward's gathers stay inside the shard group anyway")
    # a secondary group inside one shard group: its members agree on every gather (rounds)
    shard_of: dict[int, int] = {}
    for q in range(n):
        if shard_of.setdefault(member[q], _shard_index(plan, nodes, q)) != _shard_index(plan, nodes, q):
            raise ConfigError("stage3.secondary_partition", value, f"its groups of {size} ranks straddle the "
                              f"shard groups of {k} ranks (zero.shard_group): give a size dividing {k}")
    return size


def _shard_index(plan: GroupPlan, nodes: list[int], q: int) -> int:
    return nodes[q] if plan.by_node else q // plan.k


@dataclass
class ShardGroups:
    plan: GroupPlan
    dp: Any                   # all N data-parallel ranks (broadcasts from dp rank 0, the norm)
    shard: Any                # states partitioned and parameters gathered here (size K)
    reduce: Any               # the gradient reducer's communicator
    replica: Any = None       # the G ranks holding this rank's shard (None: G = 1)
    secondary: Any = None     # stage 3's backward gathers (None: off)

    @property
    def mode(self) -> str:
        return self.plan.mode

    @property
    def size(self) -> int:
        return self.shard.size

    @property
    def replicas(self) -> int:
        return 1 if self.replica is None else self.replica.size

    @property
    def shard_rank(self) -> int:
        return self.shard.rank

    @property
    def replica_rank(self) -> int:
        return 0 if self.replica is None else self.replica.rank

    def describe(self) -> str:
        sec = f", stage-3 backward gathers in groups of {self.secondary.size}" if self.secondary else ""
        if self.mode == "hybrid":
            return (f"states sharded over groups of {self.size} ranks, replicated {self.replicas} times "
                    f"(shard {self.shard_rank}, replica {self.replica_rank}){sec}")
        p = self.plan
        how = f"two levels ({p.per_node} per node x {p.nodes} nodes)" if self.mode == "two-level" else "flat"
        return f"states sharded over all {self.size} ranks, collectives {how}{sec}"


def node_map(dims) -> list[int]:
    """Each data-parallel rank's node, numbered 0.. in order of first appearance (one
    small allgather over dp; one node when the grid does not know its nodes)."""
    mine = dims.nodes.index if dims.nodes is not None else 0
    seen: dict[int, int] = {}
    return [seen.setdefault(x, len(seen)) for x in dims.dp.allgather_object(mine)]


def build(dims, cfg, stage: int) -> ShardGroups:
    """The groups of `cfg` on the grid `dims` (collective over dims.dp)."""
    from ..comm.hierarchy import Replicated, TwoLevel  # torch: decide() stays importable without it

    dp = dims.dp
    r = dp.rank
    nodes = node_map(dims)
    plan = decide(nodes, cfg.shard_group, cfg.comm.hierarchical, cfg.stage3.secondary_partition, stage)
    local = sum(1 for q in range(r) if nodes[q] == nodes[r])  # this rank's index on its node
    out = ShardGroups(plan, dp=dp, shard=dp, reduce=dp)
    if plan.mode == "two-level":
        s = local * plan.nodes + nodes[r]
        two = TwoLevel(dp.split(0, s, counted_with=dp), dp.split(nodes[r], local), dp.split(local, nodes[r]))
        out.shard, out.reduce = two, two.duplicate()
    elif plan.mode == "hybrid":
        color, pos = (nodes[r], local) if plan.by_node else (r // plan.k, r % plan.k)
        out.shard = dp.split(color, r, counted_with=dp)
        out.replica = dp.split(pos, color)
        # the reducer's own copy of the group, uncounted: Replicated counts the whole operation
        out.reduce = Replicated(out.shard.split(0, out.shard.rank), out.replica, dp)
    if plan.secondary:
        color = nodes[r] if cfg.stage3.secondary_partition == "node" else r // plan.secondary
        out.secondary = dp.split(color, r, counted_with=dp)
    return out
