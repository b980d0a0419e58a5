"""Pure shard math (no MPI, no torch): where each parameter lives in a flat buffer and
which rank owns which elements.

Layout. Parameters are packed, in the order given (the engine passes backward order),
into one flat index space, each starting at a multiple of `align`. The space is cut into
blocks of `block` elements (the communication bucket); the last block is shorter. Every
block size is a multiple of world * align, so each block splits into `world` equal,
aligned chunks, and rank r owns chunk r of every block:

    flat:   | block 0: r0 r1 r2 | block 1: r0 r1 r2 | last: r0 r1 r2 |
    shard of r1 (contiguous storage) = [block0.r1 | block1.r1 | last.r1]

Why interleave instead of one contiguous range per rank: every bucket reduce-scatter
and parameter all-gather is then a balanced, equal-count collective over all ranks
(reduce_scatter_block / allgather), instead of a reduction into one or two owners per
bucket, which serialises the traffic on the owners' links. Padding is < world * align
elements, at the end.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


@dataclass(frozen=True)
class Piece:
    """Elements [param_lo, param_hi) of parameter `index` sit at flat [flat_lo, ...)."""

    index: int
    param_lo: int
    param_hi: int
    flat_lo: int

    @property
    def size(self) -> int:
        return self.param_hi - self.param_lo

    @property
    def flat_hi(self) -> int:
        return self.flat_lo + self.size


@dataclass(frozen=True)
class Chunk:
    """A rank's chunk of one block: flat [flat_lo, flat_hi) stored at shard [shard_lo, ...)."""

    block: int
    flat_lo: int
    flat_hi: int
    shard_lo: int

    @property
    def size(self) -> int:
        return self.flat_hi - self.flat_lo


class FlatLayout:
    """Flat layout of `numels` over `world` ranks in blocks of about `block` elements."""

    def __init__(self, numels: Sequence[int], world: int, block: int, align: int = 1):
        if world < 1:
            raise ValueError(f"world size must be >= 1, got {world}")
        if align < 1:
            raise ValueError(f"alignment must be >= 1, got {align}")
        if any(n < 0 for n in numels):
            raise ValueError("parameter sizes must be >= 0")
        self.numels = [int(n) for n in numels]
        self.world, self.align = int(world), int(align)
        offsets, pos = [], 0
        for n in self.numels:
            pos = round_up(pos, align)
            offsets.append(pos)
            pos += n
        self.offsets = offsets
        self.used = pos
        unit = self.world * self.align
        self.total = max(round_up(pos, unit), unit)  # at least one (padding-only) block
        self.block = min(max(round_up(int(block), unit), unit), self.total)
        self.blocks = [(s, min(s + self.block, self.total)) for s in range(0, self.total, self.block)]
        self.shard_size = self.total // self.world

    @property
    def padding(self) -> int:
        """Elements of the flat buffer that belong to no parameter."""
        return self.total - sum(self.numels)

    def chunk_size(self, k: int) -> int:
        s, e = self.blocks[k]
        return (e - s) // self.world

    def chunks(self, rank: int) -> list[Chunk]:
        """The chunks `rank` owns, in shard order (their concatenation is its shard)."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} outside world of {self.world}")
        out, shard = [], 0
        for k, (s, _) in enumerate(self.blocks):
            c = self.chunk_size(k)
            out.append(Chunk(k, s + rank * c, s + (rank + 1) * c, shard))
            shard += c
        return out

    def owner(self, flat_index: int) -> int:
        if not 0 <= flat_index < self.total:
            raise ValueError(f"flat index {flat_index} outside [0, {self.total})")
        k = flat_index // self.block
        return (flat_index - self.blocks[k][0]) // self.chunk_size(k)

    def flat_to_shard(self, flat_index: int) -> int:
        k = flat_index // self.block
        s, _ = self.blocks[k]
        c = self.chunk_size(k)
        return k * (self.block // self.world) + (flat_index - s) % c

    def pieces(self, flat_lo: int, flat_hi: int) -> list[Piece]:
        """Parameter pieces overlapping flat [flat_lo, flat_hi), in flat order."""
        out = []
        # offsets are sorted: binary search the first parameter ending after flat_lo
        lo, hi = 0, len(self.offsets)
        while lo < hi:
            mid = (lo + hi) // 2
            if self.offsets[mid] + self.numels[mid] <= flat_lo:
                lo = mid + 1
            else:
                hi = mid
        for i in range(lo, len(self.offsets)):
            o, n = self.offsets[i], self.numels[i]
            if o >= flat_hi:
                break
            a, b = max(o, flat_lo), min(o + n, flat_hi)
            if a < b:
                out.append(Piece(i, a - o, b - o, a))
        return out

    def param_blocks(self, index: int) -> list[int]:
        """Blocks that hold some element of parameter `index`."""
        o, n = self.offsets[index], self.numels[index]
        if n == 0:
            return []
        return list(range(o // self.block, (o + n - 1) // self.block + 1))

    def owned_pieces(self, rank: int) -> list[tuple[Piece, int]]:
        """(piece, shard offset) for every parameter piece `rank` owns."""
        out = []
        for ch in self.chunks(rank):
            for p in self.pieces(ch.flat_lo, ch.flat_hi):
                out.append((p, ch.shard_lo + p.flat_lo - ch.flat_lo))
        return out
