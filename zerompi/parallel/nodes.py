"""Which ranks share a node: MPI's shared-memory split, checked and named.

    layout = discover(comm)   # collective over comm (an mpi4py communicator)
    layout.describe()         # "4 ranks on 2 nodes (2 per node)"

A node is what `Split_type(COMM_TYPE_SHARED)` groups: the ranks that can share memory,
i.e. one host. Nodes are numbered by their lowest rank, so with the block placement of
srun and mpiexec node i holds ranks i*P .. i*P+P-1. Every node must hold the same number
of ranks P: the hierarchical collectives (node-local, then across nodes) and one GPU per
node-local rank assume it, so an uneven layout is refused at start with one message.

ParallelDims builds two groups from it: `node`, the ranks of this node (node-local rank
= the rank there; GPU selection uses it), and `cross_node`, one rank per node, those with
this rank's node-local rank (size = the number of nodes), where the inter-node half of a
hierarchical collective runs.

ZEROMPI_RANKS_PER_NODE=P (environment) groups ranks into nodes of P consecutive ranks
instead of asking MPI, so tests on one host can pose as several nodes; the node names
are then the host name with "#i" appended.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from .. import runtime

ENV_RANKS_PER_NODE = "ZEROMPI_RANKS_PER_NODE"


class UnevenNodes(runtime.JobError):
    """Nodes hold different numbers of ranks (raised on every rank together)."""

    exit_code = 2


def _span(ranks) -> str:
    """'rank 3', 'ranks 0-3' (consecutive) or 'ranks 0, 2, 5'."""
    ranks = list(ranks)
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ", ".join(map(str, ranks))


@dataclass(frozen=True)
class NodeLayout:
    index: int                        # this rank's node, 0 .. count - 1
    local_rank: int                   # this rank's rank on its node
    per_node: int                     # ranks on every node
    names: tuple[str, ...]            # each node's host name
    ranks: tuple[tuple[int, ...], ...]  # each node's ranks (of the communicator split)
    forced: bool = False              # grouped by ZEROMPI_RANKS_PER_NODE, not by MPI

    @property
    def count(self) -> int:
        return len(self.names)

    @property
    def name(self) -> str:
        return self.names[self.index]

    def node_of(self, rank: int) -> int:
        return next(i for i, rs in enumerate(self.ranks) if rank in rs)

    def describe(self) -> str:
        n = sum(len(r) for r in self.ranks)
        return (f"{n} rank{'s' if n != 1 else ''} on {self.count} node{'s' if self.count != 1 else ''} "
                f"({self.per_node} per node{', ' + ENV_RANKS_PER_NODE if self.forced else ''})")

    def listing_of(self, i: int) -> str:
        """'zn1-2 (ranks 2-3)': node i and its ranks."""
        return f"{self.names[i]} ({_span(self.ranks[i])})"

    def listing(self, limit: int = 8) -> str:
        """'zn1-1 (ranks 0-1), zn1-2 (ranks 2-3)', the first `limit` nodes."""
        shown = [self.listing_of(i) for i in range(min(limit, self.count))]
        more = f" and {self.count - limit} more" if self.count > limit else ""
        return ", ".join(shown) + more

    def name_ranks(self, ranks) -> str:
        """'ranks 2, 3 (all of node zn1-2)' / 'rank 2 (on zn1-2)': ranks with their nodes."""
        ranks = sorted(ranks)
        parts = []
        for i, rs in enumerate(self.ranks):
            mine = [r for r in ranks if r in rs]
            if mine:
                parts.append(f"all of node {self.names[i]}" if len(mine) == len(rs) and len(rs) > 1
                             else f"on {self.names[i]}")
        return f"{_span(ranks)} ({'; '.join(parts)})" if parts else _span(ranks)


def forced_ranks_per_node() -> int | None:
    raw = os.environ.get(ENV_RANKS_PER_NODE, "").strip()
    if not raw:
        return None
    try:
        p = int(raw)
    except ValueError:
        p = 0
    if p < 1:
        raise ValueError(f"{ENV_RANKS_PER_NODE}={raw!r}: must be a whole number >= 1 (ranks per node)")
    return p


def discover(comm) -> NodeLayout:
    """Collective over `comm` (an mpi4py communicator): where every rank of it runs.
    Raises UnevenNodes on every rank when the nodes hold different numbers of ranks.
    (ParallelDims builds the node-local and cross-node groups from the layout.)"""
    from ..runtime import watchdog

    MPI = runtime.mpi()
    rank = comm.Get_rank()
    forced = forced_ranks_per_node()
    with watchdog.waiting("node_split"):
        if forced:
            node = comm.Split(rank // forced, rank)
        else:
            node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
        # (lowest rank of my node, my host name, where my watchdog answers) from everyone:
        # the whole map on every rank
        leader = node.allreduce(rank, op=MPI.MIN)
        gathered = comm.allgather((leader, socket.gethostname(), watchdog.side_address()))
    if MPI.Comm.Compare(comm, MPI.COMM_WORLD) in (MPI.IDENT, MPI.CONGRUENT):  # the watchdog names world ranks
        watchdog.side_peers(rank, [side for _, _, side in gathered])
    everyone = [(lead, host) for lead, host, _ in gathered]
    leaders = sorted({lead for lead, _ in everyone})
    ranks = tuple(tuple(r for r, (lead, _) in enumerate(everyone) if lead == L) for L in leaders)
    names = [everyone[L][1] for L in leaders]
    if forced or len(set(names)) < len(names):  # several "nodes" per host: tell them apart
        names = [f"{h}#{i}" for i, h in enumerate(names)]
    local_rank = node.Get_rank()
    node.Free()
    sizes = {len(rs) for rs in ranks}
    if len(sizes) > 1:
        listing = ", ".join(f"{h} ({_span(rs)})" for h, rs in zip(names[:8], ranks))
        raise UnevenNodes(
            f"uneven layout: {len(everyone)} ranks on {len(ranks)} nodes with different numbers of ranks: "
            f"{listing}{' ...' if len(ranks) > 8 else ''}. zerompi needs the same number of ranks on "
            "every node: srun --ntasks-per-node=P, or mpiexec -ppn P (-hosts h1:P,h2:P)")
    return NodeLayout(index=leaders.index(leader), local_rank=local_rank, per_node=sizes.pop(),
                      names=tuple(names), ranks=ranks, forced=bool(forced))
