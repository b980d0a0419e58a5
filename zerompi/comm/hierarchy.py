"""Communicators over groups that span nodes: collectives in two levels, and a shard
group whose result is all-reduced across replica groups. Both are chains (chain.py) of
ordinary collectives of the groups' own communicators, so they work over any backend.

TwoLevel (shard_group "world", comm.hierarchical): N = M nodes x P ranks. Rank (node n,
node-local l) takes shard index s = l * M + n, so the N chunks of a block are ordered
local-rank-major: node-local rank l's M chunks are contiguous, and each level's
collective is an equal-count one on contiguous memory, with no permutation copies.
  reduce_scatter(B -> c = B/N):
    1. inside the node: alltoall of the B elements, part q (B/P: chunks q*M .. q*M+M-1)
       to local rank q; sum the P received parts in local-rank order -> node sum (B/P)
    2. across nodes: alltoall of the node sum, chunk q to node q; sum the M received
       chunks in node order -> this rank's chunk s
  all_gather(c -> B): across nodes into this local rank's run of M chunks, then inside
  the node the P runs into the block. Copies only: bitwise a flat all-gather.
  Each rank sends (P-1)/P B inside its node and (M-1)/N B across nodes, where a flat
  alltoall sends (M-1)/M B across; a ring all-gather crosses on M links (N-1)/N B each.
  The sum is ordered per node, then across nodes: ((g0 + g1) + (g2 + g3)) at 2 x 2,
  where the flat ordered reduce-scatter adds ((g0 + g1) + g2) + g3. Both orders are
  fixed per element whatever the bucket; they differ from each other in the last bits.

Replicated (shard groups of K ranks, replicated over G = N / K groups): a reduce-scatter
inside the group, then the rank's chunk all-reduced across the G ranks holding the same
shard: alltoall of its G pieces, a sum in group order, an all-gather. Chunks are
multiples of G x alignment (the layout rounds blocks to N x alignment). Every replica
ends bitwise identical. Order: groups' ordered sums, added in group order.
"""
from __future__ import annotations

from typing import Any

import torch

from .base import CommStats
from .chain import Step, run
from .mpi import ordered_sum as _sum  # ((p0 + p1) + p2) + ... in the receiver's dtype rules


def _scratch(scratch, like: torch.Tensor, n: int) -> torch.Tensor:
    if scratch is None or scratch.numel() < n or scratch.dtype != like.dtype or scratch.device != like.device:
        return torch.empty(n, dtype=like.dtype, device=like.device)
    return scratch[:n]


class _Delegating:
    """Everything but the bucket collectives goes to `flat` (same ranks, same order)."""

    flat: Any
    _stats: CommStats

    @property
    def backend(self) -> str:
        return self.flat.backend

    @property
    def carries_gpu_tensors(self) -> bool:
        return self.flat.carries_gpu_tensors

    def set_idle(self, fn) -> None:
        self.idle = fn

    def duplicate(self):
        return self.split(0, self.rank, counted_with=self)

    def all_reduce(self, t, op: str = "sum", async_op: bool = False, scratch=None):
        return self.flat.all_reduce(t, op=op, async_op=async_op, scratch=scratch)

    def all_to_all(self, send, recv, async_op: bool = False):
        return self.flat.all_to_all(send, recv, async_op=async_op)

    def broadcast(self, t, root: int = 0) -> None:
        self.flat.broadcast(t, root=root)

    def gather(self, send, recv, root: int = 0) -> None:
        self.flat.gather(send, recv, root=root)

    def allreduce_scalars(self, values, op: str = "sum"):
        return self.flat.allreduce_scalars(values, op=op)

    def start_allreduce_scalars(self, values, op: str = "sum"):
        return self.flat.start_allreduce_scalars(values, op=op)

    def barrier(self, poll: bool = False) -> None:
        self.flat.barrier(poll=poll)

    def bcast_object(self, obj, root: int = 0):
        return self.flat.bcast_object(obj, root=root)

    def allgather_object(self, obj):
        return self.flat.allgather_object(obj)

    def stats(self) -> dict:
        return self._stats.as_dict()

    def reset_stats(self) -> None:
        self._stats.reset()


class TwoLevel(_Delegating):
    """The data-parallel group as `intra` (this node's ranks, by local rank) x `cross`
    (this local rank on every node, by node); `flat` is the whole group ordered by the
    shard index s = intra.rank * cross.size + cross.rank."""

    def __init__(self, flat, intra, cross):
        self.flat, self.intra, self.cross = flat, intra, cross
        self.P, self.M = intra.size, cross.size
        self.rank, self.size = flat.rank, flat.size
        if self.size != self.P * self.M or self.rank != intra.rank * self.M + cross.rank:
            raise ValueError(f"two-level groups do not tile the group: {self.size} ranks, {self.P} per node "
                             f"x {self.M} nodes, rank {self.rank} = ({intra.rank}, {cross.rank})")
        self._stats = flat._stats  # counted as `flat` counts (the data-parallel group's table)
        self.algorithm = flat.algorithm
        self.idle = None

    def split(self, color: int, key: int | None = None, counted_with=None) -> "TwoLevel":
        """A private copy (color 0, own rank): stage 3 takes one for its gathers (counted
        with this one: duplicate()) and one for its agreement rounds (not counted)."""
        if color != 0 or (key is not None and key != self.rank) or counted_with not in (None, self):
            raise ValueError("a two-level communicator only duplicates itself (split(0, rank))")
        flat = self.flat.split(0, self.flat.rank, counted_with=self.flat if counted_with is self else None)
        return TwoLevel(flat, self.intra.split(0, self.intra.rank), self.cross.split(0, self.cross.rank))

    def reduce_scatter(self, send, recv, op: str = "sum", async_op: bool = False, scratch=None):
        B, c = send.numel(), recv.numel()
        if B != c * self.size:
            raise ValueError(f"reduce_scatter: send has {B} elements, expected {self.size} x {c}")
        if op != "sum" or self.algorithm != "ordered":
            return self.flat.reduce_scatter(send, recv, op=op, async_op=async_op, scratch=scratch)
        self._stats.record("reduce_scatter", B, send.element_size())
        P, M, part = self.P, self.M, B // self.P
        work = _scratch(scratch, send, B + (part if P == 1 else 0))
        node_sum = send if P == 1 else work[:part]  # part 0 of the received: summed in place
        steps = []
        if P > 1:
            steps.append(Step(self.intra, lambda: self.intra.all_to_all(send, work[:B], async_op=True),
                              lambda: _sum(work[:B].view(P, part), node_sum)))
        if M > 1:
            got = work[part:2 * part] if P > 1 else work[B:B + part]
            steps.append(Step(self.cross, lambda: self.cross.all_to_all(node_sum, got, async_op=True),
                              lambda: _sum(got.view(M, c), recv)))
        else:
            steps.append(Step(self.intra, _Done, lambda: recv.copy_(node_sum)))
        return run(self._stats, "reduce_scatter", steps, async_op, keep=(send, recv, work))

    def all_gather(self, send, recv, async_op: bool = False):
        c = send.numel()
        if recv.numel() != c * self.size:
            raise ValueError(f"all_gather: recv has {recv.numel()} elements, expected {self.size} x {c}")
        self._stats.record("all_gather", recv.numel(), recv.element_size())
        l, M = self.intra.rank, self.M
        mine = recv[l * M * c:(l + 1) * M * c]  # this local rank's run: one chunk per node
        steps = [Step(self.cross, lambda: self.cross.all_gather(send, mine, async_op=True))]
        if self.P > 1:
            steps.append(Step(self.intra, lambda: self.intra.all_gather(mine, recv, async_op=True)))
        return run(self._stats, "all_gather", steps, async_op, keep=(send, recv))


class _Done:
    """A step with nothing to send (a level of size 1)."""

    def __init__(self):
        pass

    def test(self) -> bool:
        return True

    def wait(self, timeout=None) -> None:
        return None


class Replicated(_Delegating):
    """The gradient reducer's communicator when states are replicated over groups:
    reduce_scatter = the group's reduce-scatter, then the chunk all-reduced across the
    `replica` group. Other calls go to the whole data-parallel group `flat`."""

    def __init__(self, shard, replica, flat):
        self.shard, self.replica, self.flat = shard, replica, flat
        self._stats = flat._stats  # counted in the whole data-parallel group's table
        self.rank, self.size = shard.rank, shard.size
        self.algorithm = shard.algorithm
        self.idle = None

    def reduce_scatter(self, send, recv, op: str = "sum", async_op: bool = False, scratch=None):
        if op != "sum":
            raise ValueError("the replicated reducer sums only")
        B, c, G, j = send.numel(), recv.numel(), self.replica.size, self.replica.rank
        if B != c * self.size or c % G:
            raise ValueError(f"reduce_scatter: {B} elements over {self.size} ranks x {G} replicas")
        self._stats.record("reduce_scatter", B, send.element_size())
        self._stats.record("all_reduce", 2 * c, recv.element_size())  # the shard across groups
        work = _scratch(scratch, send, B)
        steps = [Step(self.shard, lambda: self.shard.reduce_scatter(send, recv, async_op=True, scratch=work))]
        if self.algorithm != "ordered":
            steps.append(Step(self.replica, lambda: self.replica.all_reduce(recv, async_op=True)))
        elif G > 1:
            piece = c // G
            mine = recv[j * piece:(j + 1) * piece]
            steps.append(Step(self.replica, lambda: self.replica.all_to_all(recv, work[:c], async_op=True),
                              lambda: _sum(work[:c].view(G, piece), mine)))
            steps.append(Step(self.replica, lambda: self.replica.all_gather(mine, recv, async_op=True)))
        return run(self._stats, "reduce_scatter", steps, async_op, keep=(send, recv, work))
