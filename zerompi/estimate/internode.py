"""What one step sends between nodes, and how long a node's link takes to carry it.

N ranks on K nodes, P = N / K per node, placed in blocks (node i holds ranks i*P ..
i*P + P - 1: srun's and mpiexec's default). Ranks of one node talk through shared
memory; everything else leaves the node on its one link, which all P ranks share. With B
the full buffer of a collective (as cost_model: reduce-scatter input, all-gather output,
all-reduce buffer), the bytes one node sends to the others are:

  all_to_all                 P (N - P) / N B   every rank sends B/N to each of N - P ranks
                                               on other nodes (any algorithm)
  all_gather  ring           (N - 1) / N B     one ring edge leaves each node; it carries
                                               N - 1 chunks of B/N
              tree           P (N - P) / N B   recursive doubling (N, P powers of two): the
                                               steps at distance >= P cross, a rank sends
                                               d chunks at distance d
  reduce_scatter ring/tree   as all_gather (reversed)
  all_reduce  ring/tree      twice all_gather's

zerompi's collectives on MPI (comm/mpi.py, the 'ordered' default) map onto these as:
reduce_scatter = an all_to_all then a local sum; a bucket all_reduce (stage 0) = an
all_to_all then an all_gather; all_gather = MPI's, which pip MPICH (5.0.2) runs as
recursive doubling below 512 KiB (MPIR_CVAR_ALLGATHER_LONG_MSG_SIZE, with N a power of
two) and as a ring above; the step's scalar all_reduce is a tree. Measured on two
simulated nodes (benchmarks/bench_multinode.py, veth counters): all_to_all 1.00-1.04 B
and all_gather 1.00 / 0.75 B per node at N = 4, P = 2, as above plus TCP/IP headers.

Time on the node link (alpha: seconds per message step, beta: seconds per byte of the
node's link, 1 / its bandwidth): steps x alpha + node bytes x beta, the collectives one
after another. Traffic inside a node (shared memory) is not in it: on a link much slower
than memory it is the link that sets the pace.
"""
from __future__ import annotations

from ..comm import cost_model

ALLGATHER_LONG_BYTES = 512 << 10  # pip MPICH: recursive doubling below, ring at and above


def _pof2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def node_bytes(op: str, nbytes: float, n: int, per_node: int, algo: str = "ring") -> float:
    """Bytes one node sends to the other nodes in one collective (module docstring)."""
    if per_node < 1 or n % per_node:
        raise ValueError(f"ranks per node = {per_node}: must divide the number of ranks ({n})")
    if per_node == n or n == 1:
        return 0.0
    cross = per_node * (n - per_node) / n * nbytes
    if op == "all_to_all":
        return cross
    if algo == "tree" and not (_pof2(n) and _pof2(per_node)):
        algo = "ring"  # recursive doubling/halving as modelled needs powers of two
    one = cross if algo == "tree" else (n - 1) / n * nbytes
    if op in ("all_gather", "reduce_scatter"):
        return one
    if op == "all_reduce":
        return 2 * one
    raise ValueError(f"op {op!r}: all_to_all, all_gather, reduce_scatter or all_reduce")


def engine_ops(row: dict, n: int) -> list[tuple[str, str]]:
    """(MPI op, algorithm) that one estimator row (sizing/dryrun collectives) runs as on
    zerompi's MPI communicator with the 'ordered' reduce-scatter."""
    op, nbytes = row["op"], row["nbytes"]
    gather = "tree" if nbytes < ALLGATHER_LONG_BYTES and _pof2(n) else "ring"
    if row.get("scalars"):
        return [("all_reduce", "tree")]
    if op == "reduce_scatter":
        return [("all_to_all", "ring")]
    if op == "all_reduce":  # ordered: all_to_all + sum, then all_gather of the sums
        return [("all_to_all", "ring"), ("all_gather", gather)]
    return [(op, gather)]


def step(rows: list[dict], n: int, nodes: int, link) -> dict:
    """Bytes each node sends per step and their time on its link, per row and in total."""
    if nodes < 1 or n % nodes:
        raise ValueError(f"--nodes {nodes}: must divide the number of ranks ({n})")
    per_node = n // nodes
    total_b = total_s = lat = 0.0
    per_row = []
    for r in rows:
        b = s = l_ = 0.0
        for op, algo in engine_ops(r, n):
            nb = node_bytes(op, r["nbytes"], n, per_node, algo)
            if nb:
                steps, _ = cost_model.coefficients(op, r["nbytes"], n, algo if op != "all_to_all" else "ring")
                b += nb
                l_ += steps * link.alpha
                s += steps * link.alpha + nb * link.beta
        per_row.append({"node_bytes_each": b, "node_bytes": b * r["count"], "seconds": s * r["count"]})
        total_b += b * r["count"]
        total_s += s * r["count"]
        lat += l_ * r["count"]
    return {"nodes": nodes, "ranks_per_node": per_node,
            "link": {"name": link.name, "alpha": link.alpha, "beta": link.beta},
            "node_bytes": total_b, "seconds": total_s, "latency_seconds": lat, "rows": per_row}
