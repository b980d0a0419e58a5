"""Pure shard math (no MPI, no torch): where each parameter lives in a flat buffer and
which rank owns which elements.

Layout. Parameters are packed, in the order given (the engine passes backward order),
into one flat index space, each starting at a multiple of `align`. The space (each
stage-3 unit's span on its own) is cut into balanced blocks of about `block` elements
(the communication bucket): a span of L elements becomes nb blocks whose sizes differ by
at most world * align, with nb = ceil(L / block) (every block <= block: the bucket is a
memory budget) or, with at_least=True, nb = max(1, L // block) (every block >= block
when L >= block: the bucket is a floor on the per-rank chunk, zero.bucket_size "auto"
at large N). No block is a short remainder. Every block size is a multiple of
world * align, so each block splits into `world` equal, aligned chunks, and rank r owns
chunk r of every block:

    flat:   | block 0: r0 r1 r2 | block 1: r0 r1 r2 | last: r0 r1 r2 |
    shard of r1 (contiguous storage) = [block0.r1 | block1.r1 | last.r1]

Why interleave instead of one contiguous range per rank: every bucket reduce-scatter
and parameter all-gather is then a balanced, equal-count collective over all ranks
(reduce_scatter_block / allgather), instead of a reduction into one or two owners per
bucket, which serialises the traffic on the owners' links. Padding is < world * align
elements, at the end.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Iterator, NamedTuple, Sequence


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def split_span(s: int, e: int, block: int, unit: int, at_least: bool = False) -> list[tuple[int, int]]:
    """Balanced blocks of the span [s, e) (s, e, block: multiples of `unit`): nb blocks
    of q // nb or q // nb + 1 units (q = (e - s) / unit, the larger ones first), with
    nb = ceil(q / b) so that every block <= block, or with at_least nb = max(1, q // b)
    so that every block >= block whenever the span is (b = block / unit). An empty span
    has no blocks."""
    q, b = (e - s) // unit, block // unit
    if q == 0:
        return []
    nb = max(1, q // b) if at_least else -(-q // b)
    base, extra = divmod(q, nb)
    out, pos = [], s
    for i in range(nb):
        size = (base + (i < extra)) * unit
        out.append((pos, pos + size))
        pos += size
    return out


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


class Span(NamedTuple):
    """Where one owned chunk sits, as slices: in the rank's shard, and - relative to a
    flat offset `base` (0, or a stage-3 unit's start) - its whole block and its own part
    of that block. Every all-gather of a block, every copy between flat and shard
    storage, walks these."""

    chunk: Chunk
    shard: slice
    block: slice
    mine: slice


class FlatLayout:
    """Flat layout of `numels` over `world` ranks in blocks of about `block` elements.

    `units` (optional) groups consecutive parameters (counts per unit, summing to
    len(numels)); each unit starts on a block boundary so it can be gathered alone
    (stage 3 gathers one module's parameters at a time). Default: one unit.

    Each span is cut into balanced blocks (`split_span`): at most `block` elements each
    (rounded up to a multiple of world * align), or with at_least=True at least `block`
    each when the span holds that many (and below (1 + 1/nb) x block). `self.block` is
    the largest block actually used: buffers are sized from it.

    `replicas` (hybrid sharding, zero/groups.py: `world` ranks per shard group, the
    layout replicated over `replicas` groups): blocks are multiples of world x replicas
    x align, so each chunk splits evenly over the replicas for the all-reduce across
    groups; the blocks (and padding) are then those of the flat layout over all ranks."""

    def __init__(self, numels: Sequence[int], world: int, block: int, align: int = 1,
                 units: Sequence[int] | None = None, at_least: bool = False, replicas: int = 1):
        if world < 1 or replicas < 1:
            raise ValueError(f"world size and replicas must be >= 1, got {world} and {replicas}")
        if align < 1:
            raise ValueError(f"alignment must be >= 1, got {align}")
        if any(n < 0 for n in numels):
            raise ValueError("parameter sizes must be >= 0")
        units = [len(numels)] if units is None else [int(u) for u in units]
        if sum(units) != len(numels) or any(u < 0 for u in units):
            raise ValueError(f"units {units} do not partition {len(numels)} parameters")
        self.numels = [int(n) for n in numels]
        self.world, self.align, self.replicas = int(world), int(align), int(replicas)
        unit = self.world * self.replicas * self.align
        offsets, pos, i, spans = [], 0, 0, []
        for count in units:
            start = pos
            for _ in range(count):
                pos = round_up(pos, align)
                offsets.append(pos)
                pos += self.numels[i]
                i += 1
            pos = round_up(pos, unit)
            spans.append((start, pos))
        self.offsets = offsets
        self._ends = [o + n for o, n in zip(offsets, self.numels)]  # non-decreasing: pieces() bisects it
        self.used = max(self._ends, default=0)
        self.total = max(pos, unit)  # at least one (padding-only) block
        if pos == 0:  # nothing but empty parameters: one padding block
            spans = [(0, unit)] + spans[1:] if spans else [(0, unit)]
        self.requested = max(round_up(int(block), unit), unit)  # the bucket, in whole units
        self.at_least = bool(at_least)
        self.blocks: list[tuple[int, int]] = []
        self.unit_blocks: list[range] = []  # block indices of each unit
        for s, e in spans:
            first = len(self.blocks)
            self.blocks += split_span(s, e, self.requested, unit, self.at_least)
            self.unit_blocks.append(range(first, len(self.blocks)))
        self.block = max(e - s for s, e in self.blocks)  # the largest: buffers are sized from it
        self.unit_spans = spans
        self.unit_params: list[range] = []
        i = 0
        for count in units:
            self.unit_params.append(range(i, i + count))
            i += count
        self._starts = [s for s, _ in self.blocks]
        self.block_shard_lo, acc = [], 0
        for s, e in self.blocks:
            self.block_shard_lo.append(acc)
            acc += (e - s) // self.world
        self.shard_size = self.total // self.world

    @property
    def padding(self) -> int:
        """Elements of the flat buffer that belong to no parameter."""
        return self.total - sum(self.numels)

    @property
    def alone(self) -> bool:
        """Over one rank and not replicated: that rank owns every block whole, so nothing
        is reduced or gathered (the engine's local reducer; the estimator counts none)."""
        return self.world == 1 and self.replicas == 1

    def chunk_size(self, k: int) -> int:
        s, e = self.blocks[k]
        return (e - s) // self.world

    def chunks(self, rank: int) -> list[Chunk]:
        """The chunks `rank` owns, in shard order (their concatenation is its shard)."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} outside world of {self.world}")
        out = []
        for k, (s, _) in enumerate(self.blocks):
            c = self.chunk_size(k)
            out.append(Chunk(k, s + rank * c, s + (rank + 1) * c, self.block_shard_lo[k]))
        return out

    def spans(self, chunks: Sequence[Chunk], blocks: Sequence[int] | None = None,
              base: int = 0) -> Iterator[Span]:
        """The one loop over owned chunks: a Span for each of `chunks` (restricted to
        `blocks` when given, e.g. one unit's), flat slices relative to `base`."""
        if blocks is not None:
            by_block = {c.block: c for c in chunks}
            chunks = [by_block[k] for k in blocks]
        for c in chunks:
            s, e = self.blocks[c.block]
            yield Span(c, slice(c.shard_lo, c.shard_lo + c.size), slice(s - base, e - base),
                       slice(c.flat_lo - base, c.flat_hi - base))

    def block_of(self, flat_index: int) -> int:
        return bisect.bisect_right(self._starts, flat_index) - 1

    def owner(self, flat_index: int) -> int:
        if not 0 <= flat_index < self.total:
            raise ValueError(f"flat index {flat_index} outside [0, {self.total})")
        k = self.block_of(flat_index)
        return (flat_index - self.blocks[k][0]) // self.chunk_size(k)

    def flat_to_shard(self, flat_index: int) -> int:
        k = self.block_of(flat_index)
        s, _ = self.blocks[k]
        return self.block_shard_lo[k] + (flat_index - s) % self.chunk_size(k)

    def pieces(self, flat_lo: int, flat_hi: int) -> list[Piece]:
        """Parameter pieces overlapping flat [flat_lo, flat_hi), in flat order."""
        out = []
        # the first parameter ending after flat_lo (C bisect: the dry run of a 1T model
        # calls this once per owned chunk, ~200k times per rank checked)
        for i in range(bisect.bisect_right(self._ends, flat_lo), len(self.offsets)):
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
        return list(range(self.block_of(o), self.block_of(o + n - 1) + 1))

    def owned_pieces(self, rank: int) -> list[tuple[Piece, int]]:
        """(piece, shard offset) for every parameter piece `rank` owns."""
        out = []
        for ch in self.chunks(rank):
            for p in self.pieces(ch.flat_lo, ch.flat_hi):
                out.append((p, ch.shard_lo + p.flat_lo - ch.flat_lo))
        return out
