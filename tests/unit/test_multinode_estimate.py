"""The estimator across nodes (zerompi/estimate/hierarchy.py; `--ranks-per-node P` or
`--nodes K`): the bytes each group of a sub-collective sends across and inside nodes
against brute-force counts and the simulated cluster's measurements, the engine's
collectives mapped onto MPI's, the run's own mode (its config's zero.* keys) in the
sizing, every mode priced at 4096 ranks, the time on a node's links, and the CLI. Pure
arithmetic, no MPI (the measurements: benchmarks/bench_nodes.py)."""
from __future__ import annotations

import json

import pytest

from zerompi.comm.cost_model import Link
from zerompi.estimate import api
from zerompi.estimate.hierarchy import algorithm, wire

B = 1 << 20       # ring all-gathers (>= 512 KiB)
SMALL = 1 << 16   # recursive doubling (< 512 KiB, powers of two)


def _node(r: int, p: int) -> int:
    return r // p


def brute_force_all_to_all(n: int, p: int, nbytes: float) -> tuple[float, float]:
    """(bytes node 0 sends to other nodes, the most one rank sends across): every rank
    sends nbytes/n to every other rank."""
    per_rank = [sum(nbytes / n for dst in range(n) if _node(dst, p) != _node(src, p)) for src in range(n)]
    return sum(per_rank[:p]), max(per_rank)


def brute_force_ring_gather(n: int, p: int, nbytes: float) -> tuple[float, float]:
    # ring r -> r+1 in communicator order: each edge carries n - 1 chunks
    per_rank = [(n - 1) * nbytes / n if _node((src + 1) % n, p) != _node(src, p) else 0.0 for src in range(n)]
    return sum(per_rank[:p]), max(per_rank)


def brute_force_doubling_gather(n: int, p: int, nbytes: float) -> tuple[float, float]:
    # recursive doubling: at distance d every rank sends the d chunks it holds to r ^ d
    per_rank = [0.0] * n
    d = 1
    while d < n:
        for src in range(n):
            if _node(src ^ d, p) != _node(src, p):
                per_rank[src] += d * nbytes / n
        d *= 2
    return sum(per_rank[:p]), max(per_rank)


def node_and_rank(kind: str, nbytes: float, n: int, p: int) -> tuple[float, float]:
    """wire()'s answer for all n ranks on n / p nodes: (bytes per node, busiest rank)."""
    cross, intra, rank = wire(kind, nbytes, n, n // p, p)
    assert cross + intra == pytest.approx((2 if kind == "allreduce" else 1) * (n - 1) / n * nbytes * n)
    return cross / (n // p), rank


@pytest.mark.parametrize("n,p", [(4, 2), (8, 2), (8, 4), (16, 4), (6, 3), (12, 2)])
def test_bytes_across_nodes_equal_a_brute_force_count(n, p):
    assert node_and_rank("alltoall", B, n, p) == pytest.approx(brute_force_all_to_all(n, p, B))
    assert node_and_rank("allgather", B, n, p) == pytest.approx(brute_force_ring_gather(n, p, B))
    ring2 = tuple(2 * x for x in brute_force_ring_gather(n, p, SMALL))
    if n & (n - 1) == 0:  # MPICH's recursive doubling below 512 KiB at powers of two, else a ring
        assert algorithm("allgather", SMALL, n) == "tree"
        assert node_and_rank("allgather", SMALL, n, p) == pytest.approx(brute_force_doubling_gather(n, p, SMALL))
        ring2 = tuple(2 * x for x in brute_force_doubling_gather(n, p, SMALL))
    else:
        assert node_and_rank("allgather", SMALL, n, p) == pytest.approx(brute_force_ring_gather(n, p, SMALL))
    # the scalar all-reduce: a tree, reduce-scatter + all-gather, twice the all-gather's bytes
    assert node_and_rank("allreduce", SMALL, n, p) == pytest.approx(ring2)


def test_one_node_sends_nothing_and_bad_layouts_are_refused():
    assert wire("alltoall", B, 4, 1, 4) == (0.0, 3 * B, 0.0)
    assert wire("allgather", B, 4, 1, 4)[0] == 0.0
    with pytest.raises(ValueError, match="--nodes 3: must divide every N of --dp"):
        api.placement([4], nodes=3)
    with pytest.raises(ValueError, match="--ranks-per-node 4 does not divide N = 6"):
        api.placement([8, 6], ranks_per_node=4)
    assert api.placement([4, 8], nodes=2) == {4: 2, 8: 4} and api.placement([4], None, None) is None


def test_wire_model_matches_the_simulated_cluster():
    """The byte counts measured on 2 simulated nodes x 2 ranks (MPICH over TCP, veth
    counters, benchmarks/bench_nodes.py): an 8 MiB alltoall sends 2.0 x 8 MiB across
    nodes, a ring all-gather 1.5 x, a 64 KiB all-gather (recursive doubling) 2.0 x."""
    B8 = 8 << 20
    assert wire("alltoall", B8, 4, 2, 2)[0] == 2 * B8
    assert wire("allgather", B8, 4, 2, 2)[0] == 1.5 * B8
    assert wire("allgather", 1 << 16, 4, 2, 2)[0] == 2 * (1 << 16)
    assert wire("alltoall", B8, 2, 1, 2)[:2] == (0, B8)    # inside a node: nothing across
    assert wire("allgather", B8, 2, 2, 1)[:2] == (B8, 0)   # across: one rank per node


def test_engine_collectives_map_to_mpi_as_measured():
    """The ordered reduce-scatter is an alltoall; stage 0's bucket all-reduce an alltoall
    plus an all-gather on all N; pip MPICH's all-gather is recursive doubling below 512
    KiB at a power of two, a ring otherwise; the step's scalars a tree all-reduce on all N."""
    assert algorithm("alltoall", 8 << 20, 4) == "ring"
    assert algorithm("allgather", 8 << 20, 4) == "ring" and algorithm("allgather", 256 << 10, 4) == "tree"
    assert algorithm("allgather", 256 << 10, 6) == "ring" and algorithm("allreduce", 424, 6) == "tree"
    res = api.size("small", [4], [0], precision="fp32", alpha=0.0, beta=1e-9, nodes=2, modes={})
    rows = res["runs"][0]["nodes"]["rows"]
    assert [(r["what"], r["kind"], r["group"], r["n"]) for r in rows] == [
        ("reduce", "allgather", "world", 4), ("reduce", "alltoall", "world", 4), ("scalars", "allreduce", "world", 4)]


def _small(stage: int, **kw) -> dict:
    return api.size("small", [4], [stage], precision="fp32", alpha=0.0, beta=1 / 12.5e6, nodes=2, nics_per_node=1,
                    modes={}, **kw)["runs"][0]


def test_sizing_with_nodes_counts_every_collective_in_the_runs_mode():
    """Stage 2 of the small GPT at 4 ranks on 2 nodes: one fp32 block of T elements. Flat
    (comm.hierarchical off): reduce-scattered as an alltoall (T*4/4*2*2 bytes leave each
    node) and all-gathered on a ring (3/4 of it), plus the tree all-reduce of the scalars;
    on one link per node the time is those bytes x beta. The default (auto) spans 2 nodes
    with 2 ranks on each, so it is two-level: the alltoall and the all-gather of the node's
    half cross, 1/2 + 1/2 of the block per node: 4/7 of flat's."""
    beta = 1 / 12.5e6
    flat = _small(2, hierarchical="off")
    T, nodes = flat["padded"], flat["nodes"]
    blocks = [r for r in flat["collectives"] if not r["scalars"]]
    assert [r["elements"] for r in blocks] == [T, T] and nodes["ranks_per_node"] == 2 and nodes["mode"] == "flat"
    (sc,) = [r for r in flat["collectives"] if r["scalars"]]
    scalars = 2 * (2 * 2 / 4) * sc["nbytes"]  # tree all-reduce of the norm and the used flags
    assert nodes["node_link_bytes"] == pytest.approx(T * 4 * (1 + 3 / 4) + scalars, rel=1e-12)
    assert nodes["time"]["seconds"] == pytest.approx(nodes["node_link_bytes"] * beta, rel=1e-12)
    default = _small(2)["nodes"]
    assert default["settings"]["hierarchical"] == "auto" and default["mode"] == "two-level"
    assert default["node_link_bytes"] == pytest.approx(T * 4 * (1 / 2 + 1 / 2) + scalars, rel=1e-12)
    hybrid = _small(2, shard_group="node")  # the sizing's own states follow the mode: K = 2
    assert (hybrid["shard_group"], hybrid["replicas"], hybrid["nodes"]["mode"]) == (2, 2, "hybrid")
    states = hybrid["model_states"]["model_states"]
    assert states == hybrid["nodes"]["model_states"] > flat["model_states"]["model_states"]


def test_time_on_a_node_link_shared_or_one_per_rank():
    """A link between nodes per rank (the presets' reading, default) or one shared by the
    node's ranks (--nics-per-node 1): a flat ring all-gather spanning nodes costs
    (n-1)/n B beta either way (one rank per node drives the crossing edge); a two-level
    collective's cross level (P parallel groups of M) costs (M-1)/M B/P beta per rank on
    its own link, P times that on a shared one."""
    from zerompi.estimate.hierarchy import step_time

    link, fast = Link("x", 0.0, 1e-9), Link("y", 0.0, 0.0)
    n, p = 8, 4
    cross, _, rank = wire("allgather", B, n, 2, p)
    ring = {"kind": "allgather", "algo": "ring", "nbytes": B, "n": n, "nodes": 2, "count": 1,
            "node_bytes": cross / 2, "rank_cross_each": rank}
    assert step_time([dict(ring)], link, fast, nics=p)["seconds"] == pytest.approx(7 / 8 * B * 1e-9)
    assert step_time([dict(ring)], link, fast, nics=1)["seconds"] == pytest.approx(7 / 8 * B * 1e-9)
    c2, _, r2 = wire("alltoall", B / p, 2, 2, 1)
    level = {"kind": "alltoall", "algo": "ring", "nbytes": B / p, "n": 2, "nodes": 2, "count": 1,
             "node_bytes": c2 * p / 2, "rank_cross_each": r2}
    assert step_time([dict(level)], link, fast, nics=p)["seconds"] == pytest.approx(B / p / 2 * 1e-9)
    assert step_time([dict(level)], link, fast, nics=1)["seconds"] == pytest.approx(B / 2 * 1e-9)


def test_estimator_prices_every_mode_at_4096_ranks(capsys):
    """The dry run's layouts at N = 4096 with 8 ranks per node: per-rank states are the
    paper's formula at K; two-level and hybrid-by-node cut the bytes across nodes
    (7.5B GPT, stage 3, bf16); the run's own mode (auto: two-level) is marked; the CLI's
    --json parses, bad input is one line, status 2."""
    from zerompi.estimate.cli import main
    from zerompi.estimate.memory import model_states

    res = api.size("gpt-7.5b", [4096], [3], ranks_per_node=8, link="ndr-ib")
    by = {r["settings"]["hierarchical"] + "/" + str(r["settings"]["shard_group"]) + "/"
          + r["settings"]["secondary"]: r for r in res["nodes"]["modes"]}
    flat, two, node = by["off/world/off"], by["on/world/off"], by["auto/node/off"]
    sec = by["off/world/node"]
    assert (node["shard_group"], node["replicas"], two["mode"]) == (8, 512, "two-level")
    assert [r["name"] for r in res["nodes"]["modes"] if r["own"]] == ["two-level"]
    mine = res["runs"][0]["nodes"]
    assert mine["mode"] == "two-level" and mine["settings"]["hierarchical"] == "auto"
    assert node["model_states"] == model_states(node["padded"], 8, 3, "bf16")["model_states"]
    assert flat["model_states"] == model_states(flat["padded"], 4096, 3, "bf16")["model_states"]
    assert two["cross_bytes_per_rank"] < flat["cross_bytes_per_rank"] / 4
    assert node["cross_bytes_per_rank"] < flat["cross_bytes_per_rank"] / 4
    assert sec["secondary_bytes"] == sec["padded"] // 8 * 2
    assert sec["cross_bytes_per_rank"] < flat["cross_bytes_per_rank"]
    assert two["time"]["seconds"] < flat["time"]["seconds"] / 3

    assert main(["--model", "gpt-7.5b", "--dp", "1024", "--stage", "3", "--ranks-per-node", "8", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["nodes"]["modes"]) == 5
    assert main(["--model", "gpt-7.5b", "--dp", "1020", "--ranks-per-node", "8"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "ranks-per-node" in err, err


def test_cli_nodes(capsys):
    """In-process (python -m zerompi.estimate is cli.main): --nodes K is --ranks-per-node
    N/K; JSON, the text table, one-line errors."""
    from zerompi.estimate.cli import main

    common = ["--model", "small", "--dp", "4", "--precision", "fp32", "--alpha", "5e-5", "--beta", "8e-8",
              "--nics-per-node", "1", "--stage", "3", "--json"]
    assert main(common + ["--nodes", "2"]) == 0
    it = json.loads(capsys.readouterr().out)["runs"][0]["nodes"]
    assert main(common + ["--ranks-per-node", "2"]) == 0
    assert json.loads(capsys.readouterr().out)["runs"][0]["nodes"] == it
    assert it["nodes"] == 2 and it["node_link_bytes"] > 0 and it["time"]["seconds"] > it["node_link_bytes"] * 8e-8
    assert main(common[:-3] + ["--nodes", "2", "--stage", "2", "--hierarchical", "off"]) == 0
    out = capsys.readouterr().out
    assert "Across nodes" in out and "* flat (flat)" in out and "two-level (two-level)" in out
    assert main(common[:-3] + ["--nodes", "2", "--stage", "2"]) == 0  # the default: auto, two-level here
    out = capsys.readouterr().out
    assert "* two-level (two-level)" in out and "comm.hierarchical auto" in out
    assert main(["--model", "small", "--dp", "4,6", "--nodes", "4", "--beta", "1e-9", "--alpha", "0"]) == 2
    assert capsys.readouterr().err.strip() == "zerompi.estimate: error: --nodes 4: must divide every N of --dp (not 6)"
    assert main(["--model", "small", "--dp", "4", "--nics-per-node", "1"]) == 2
    assert "--nics-per-node goes with" in capsys.readouterr().err


def test_tp_groups_fill_nodes_and_share_their_links():
    """With tp T a node of P ranks holds P/T whole tp groups (ParallelDims: ranks r // T),
    so a data-parallel group has P/T ranks on it, and the node's T groups (one per tp
    rank) move the same bytes at once: each gets 1/T of the node's links."""
    assert api.placement([512], ranks_per_node=8, tp=8) == {512: 1}
    assert api.placement([64], ranks_per_node=8, tp=2) == {64: 4}
    assert api.placement([64], nodes=16, tp=4) == {64: 4}  # K nodes: N / K of each group
    with pytest.raises(ValueError, match="--ranks-per-node 6: a node must hold whole tp groups of tp 4"):
        api.placement([8], ranks_per_node=6, tp=4)
    with pytest.raises(ValueError, match=r"--ranks-per-node 8 does not divide N = 6 data-parallel ranks \(x tp 2\)"):
        api.placement([6], ranks_per_node=8, tp=2)
    link = Link("test", 5e-6, 1 / 25e9)
    at = lambda tp, rpn, nics: api.size("gpt2", [16], [3], tp=tp, ranks_per_node=rpn, nics_per_node=nics,  # noqa: E731
                                        link=link, modes={})["runs"][0]["nodes"]
    two = at(2, 8, 2)
    assert two["ranks_per_node"] == 4 and two["nics_per_node"] == 2 and two["nics_per_group"] == 1
    # the same data-parallel layout with one link of its own per node: the same time, and
    # the node's link carries both tp ranks' groups
    from zerompi.estimate import hierarchy, models
    from zerompi.estimate.dryrun import DryRun

    runner = DryRun(models.from_preset("gpt2"), api.ZeroConfig(precision="bf16"), tp=2)
    one = hierarchy.price(runner, 16, 4, 3, hierarchy.settings_of(runner.zcfg), "bf16", 1, "param",
                          None, link, api.resolve_link("nvlink"), 1)
    assert two["time"]["seconds"] == pytest.approx(one["time"]["seconds"])
    assert two["node_link_bytes"] == 2 * one["node_link_bytes"] > 0
    assert two["cross_bytes_total"] == 2 * one["cross_bytes_total"]
    assert two["cross_bytes_per_rank"] == one["cross_bytes_per_rank"]
    # tp 4 on nodes of 4: one rank of each group per node, so every byte crosses
    four = at(4, 4, None)
    assert four["ranks_per_node"] == 1 and four["intra_bytes_per_rank"] == 0 < four["cross_bytes_per_rank"]
