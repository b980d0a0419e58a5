"""The estimator's inter-node model (zerompi/estimate/internode.py, `--nodes`): bytes one
node sends per collective for N ranks in blocks of P per node, zerompi's collectives
mapped onto MPI's, and the CLI. Pure arithmetic, no MPI (the measurement against a
shaped link is benchmarks/bench_multinode.py)."""
from __future__ import annotations

import json

import pytest

from zerompi.comm import cost_model
from zerompi.estimate import api
from zerompi.estimate.internode import engine_ops, node_bytes, step

B = 1 << 20


def brute_force_all_to_all(n: int, p: int) -> float:
    """Bytes node 0 sends when every rank sends B/n to every other rank."""
    return sum(B / n for src in range(p) for dst in range(n) if dst // p != 0)


def brute_force_ring_gather(n: int, p: int) -> float:
    # ring r -> r+1: each edge carries n - 1 chunks; node 0's outgoing edges that cross
    return sum((n - 1) * B / n for src in range(p) if ((src + 1) % n) // p != 0)


def brute_force_doubling_gather(n: int, p: int) -> float:
    # recursive doubling: at distance d every rank sends the d chunks it holds to r ^ d
    total, d = 0.0, 1
    while d < n:
        total += sum(d * B / n for src in range(p) if (src ^ d) // p != 0)
        d *= 2
    return total


@pytest.mark.parametrize("n,p", [(4, 2), (8, 2), (8, 4), (16, 4), (6, 3), (12, 2)])
def test_node_bytes_equal_a_brute_force_count(n, p):
    assert node_bytes("all_to_all", B, n, p) == pytest.approx(brute_force_all_to_all(n, p))
    assert node_bytes("all_gather", B, n, p, "ring") == pytest.approx(brute_force_ring_gather(n, p))
    assert node_bytes("reduce_scatter", B, n, p, "ring") == pytest.approx(brute_force_ring_gather(n, p))
    assert node_bytes("all_reduce", B, n, p, "ring") == pytest.approx(2 * brute_force_ring_gather(n, p))
    if n & (n - 1) == 0 and p & (p - 1) == 0:
        assert node_bytes("all_gather", B, n, p, "tree") == pytest.approx(brute_force_doubling_gather(n, p))


def test_one_node_sends_nothing_and_bad_layouts_are_refused():
    assert node_bytes("all_to_all", B, 4, 4) == 0.0
    with pytest.raises(ValueError, match="must divide the number of ranks"):
        node_bytes("all_gather", B, 6, 4)
    with pytest.raises(ValueError, match="--nodes 3: must divide"):
        step([], 4, 3, cost_model.Link("x", 0, 1e-9))


def test_engine_collectives_map_to_mpi_as_measured():
    """The ordered reduce-scatter is an all-to-all; stage 0's bucket all-reduce an all-to-all
    plus an all-gather; pip MPICH's all-gather is recursive doubling below 512 KiB."""
    row = lambda op, nbytes, scalars=False: {"op": op, "nbytes": nbytes, "scalars": scalars}  # noqa: E731
    assert engine_ops(row("reduce_scatter", 8 << 20), 4) == [("all_to_all", "ring")]
    assert engine_ops(row("all_reduce", 8 << 20), 4) == [("all_to_all", "ring"), ("all_gather", "ring")]
    assert engine_ops(row("all_gather", 256 << 10), 4) == [("all_gather", "tree")]
    assert engine_ops(row("all_gather", 256 << 10), 6) == [("all_gather", "ring")]
    assert engine_ops(row("all_reduce", 424, True), 4) == [("all_reduce", "tree")]


def test_sizing_with_nodes_counts_every_collective():
    """Stage 2 of the small GPT at 4 ranks on 2 nodes: one fp32 block of T elements,
    reduce-scattered (all-to-all: T*4/4*2*2 bytes) and all-gathered (ring: 3/4 of it)."""
    beta = 1 / 12.5e6
    res = api.size("small", [4], [2], precision="fp32", alpha=0.0, beta=beta, nodes=2)["runs"][0]
    T = res["padded"]
    it = res["internode"]
    blocks = [r for r in res["collectives"] if not r["scalars"]]
    assert [r["elements"] for r in blocks] == [T, T] and it["ranks_per_node"] == 2
    (sc,) = [r for r in res["collectives"] if r["scalars"]]
    scalars = 2 * (2 * 2 / 4) * sc["nbytes"]  # tree all-reduce of the norm and the used flags
    assert it["node_bytes"] == pytest.approx(T * 4 * (1 + 3 / 4) + scalars, rel=1e-12)
    assert it["seconds"] == pytest.approx(it["node_bytes"] * beta, rel=1e-12)


def test_cli_nodes(capsys):
    """In-process (python -m zerompi.estimate is cli.main): JSON, the text table, one-line errors."""
    from zerompi.estimate.cli import main

    common = ["--model", "small", "--dp", "4", "--nodes", "2", "--precision", "fp32", "--alpha", "5e-5",
              "--beta", "8e-8"]
    assert main(common + ["--stage", "3", "--json"]) == 0
    it = json.loads(capsys.readouterr().out)["runs"][0]["internode"]
    assert it["nodes"] == 2 and it["node_bytes"] > 0 and it["seconds"] > it["node_bytes"] * 8e-8
    assert main(common + ["--stage", "2"]) == 0
    assert "MiB each node sends" in capsys.readouterr().out
    assert main(["--model", "small", "--dp", "4,6", "--nodes", "4", "--beta", "1e-9", "--alpha", "0"]) == 2
    assert capsys.readouterr().err.strip() == "zerompi.estimate: error: --nodes 4: must divide every N of --dp (not 6)"
