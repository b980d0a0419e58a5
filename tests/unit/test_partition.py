"""Property tests of the flat block-interleaved layout (zerompi/zero/partition.py), no MPI.

Random parameter lists (empty, scalar, odd, prime, one huge parameter spanning many
blocks) x world sizes 1..17 x block sizes around the total x alignments 1/4/16. The
expected ownership is rebuilt with numpy from first principles and compared with every
query of FlatLayout; per-element queries are checked exhaustively on small layouts and
on chunk boundaries plus a random sample on large ones, to keep the run fast.
"""
from __future__ import annotations

import random

import numpy as np
import pytest

from zerompi.zero.partition import FlatLayout, round_up

PRIMES = [2, 3, 5, 7, 11, 13, 17, 31, 97, 101, 257, 509, 1021, 4093]
MAX_BLOCKS = 24
EXHAUSTIVE = 1000  # check owner()/flat_to_shard() on every element below this total


def random_sizes(rng: random.Random) -> list[int]:
    kind = rng.randrange(6)
    if kind == 0:
        return []
    if kind == 1:
        return [0] * rng.randint(1, 4)  # only empty parameters: a padding-only layout
    sizes = []
    for _ in range(rng.randint(1, 12)):
        r = rng.random()
        if r < 0.15:
            sizes.append(0)
        elif r < 0.3:
            sizes.append(1)  # scalar parameter
        elif r < 0.55:
            sizes.append(rng.choice(PRIMES))
        else:
            sizes.append(rng.randrange(1, 200) | 1)  # odd
    if kind >= 4:  # one huge parameter that spans many blocks
        sizes.insert(rng.randrange(len(sizes) + 1), rng.randint(2000, 9000))
    return sizes


def block_requests(rng: random.Random, used: int, world: int, align: int) -> list[int]:
    unit = world * align
    total = max(round_up(used, unit), unit)
    reqs = {1, unit, total, total + rng.randint(1, 100), 10 * total + 7}
    if total > 2:
        reqs.add(rng.randint(2, total - 1))  # smaller than the total, not aligned
        reqs.add(max(1, total // 7))
    if used > 1:
        reqs.add(used)
    # at most ~MAX_BLOCKS blocks: the checks are O(blocks x world) and many-block cases
    # add nothing once a parameter already spans dozens of blocks
    floor = -(-total // MAX_BLOCKS)
    return sorted({max(r, floor) for r in reqs})


def check_layout(numels: list[int], world: int, req_block: int, align: int,
                 rng: random.Random, at_least: bool = False) -> None:
    L = FlatLayout(numels, world, req_block, align, at_least=at_least)
    unit = world * align

    # ---- offsets: packed in order, aligned, gaps < align
    end = 0
    for i, n in enumerate(numels):
        o = L.offsets[i]
        assert o % align == 0
        assert end <= o < end + align
        end = o + n
    used = end
    assert L.used == used

    # ---- total / padding: a multiple of world*align, tail padding < world*align except
    # that a layout without elements still gets one whole padding-only block
    assert L.total % unit == 0
    tail = L.total - used
    if used == 0:
        assert L.total == unit and tail == unit
    else:
        assert 0 <= tail < unit
    gaps = used - sum(numels)
    assert 0 <= gaps <= max(0, len(numels) - 1) * (align - 1)
    assert L.padding == L.total - sum(numels) == tail + gaps

    # ---- blocks: each a multiple of world*align, contiguous, cover [0, total), balanced
    # (sizes differ by at most world*align, larger first: no short remainder), each <= the
    # requested block, or with at_least >= it whenever the whole span is
    req = round_up(max(req_block, 1), unit)
    assert L.requested == req and L.at_least == at_least
    assert L.blocks[0][0] == 0 and L.blocks[-1][1] == L.total
    sizes = [e - s for s, e in L.blocks]
    nb = len(sizes)
    assert L.block == max(sizes) and max(sizes) - min(sizes) <= unit
    assert sizes == sorted(sizes, reverse=True)
    if not at_least:
        assert nb == -(-L.total // req) and max(sizes) <= req
    elif L.total >= req:
        assert nb == L.total // req and min(sizes) >= req
        assert max(sizes) <= req + req // nb + unit  # at most about (1 + 1/nb) x the bucket
    else:
        assert sizes == [L.total]
    for k, (s, e) in enumerate(L.blocks):
        assert 0 < e - s and (e - s) % unit == 0
        if k + 1 < len(L.blocks):
            assert L.blocks[k + 1][0] == e
        assert L.chunk_size(k) * world == e - s and L.chunk_size(k) % align == 0
    assert L.shard_size * world == L.total

    # ---- chunks: rank r owns chunk r of every block, equal sizes across ranks,
    # concatenated in shard order they form [0, shard_size)
    owner = np.full(L.total, -1, dtype=np.int64)
    shard_of = np.full(L.total, -1, dtype=np.int64)
    all_chunks = []
    for r in range(world):
        chunks = L.chunks(r)
        assert [c.block for c in chunks] == list(range(len(L.blocks)))
        pos = 0
        for c in chunks:
            s, _ = L.blocks[c.block]
            cs = L.chunk_size(c.block)
            assert c.size == cs and c.flat_lo == s + r * cs and c.flat_hi == s + (r + 1) * cs
            assert c.flat_lo % align == 0
            assert c.shard_lo == pos
            pos += c.size
            assert (owner[c.flat_lo:c.flat_hi] == -1).all(), "chunks overlap"
            owner[c.flat_lo:c.flat_hi] = r
            shard_of[c.flat_lo:c.flat_hi] = np.arange(c.shard_lo, c.shard_lo + c.size)
            all_chunks.append(c)
        assert pos == L.shard_size
    assert (owner >= 0).all(), "chunks leave flat elements unowned"

    # ---- owner() and flat_to_shard() agree with chunks()
    if L.total <= EXHAUSTIVE:
        idx = range(L.total)
    else:
        idx = {i for c in all_chunks for i in (c.flat_lo, c.flat_hi - 1)}
        idx |= {rng.randrange(L.total) for _ in range(200)}
    for i in idx:
        assert L.owner(i) == owner[i], i
        assert L.flat_to_shard(i) == shard_of[i], i
    for bad in (-1, L.total):
        with pytest.raises(ValueError):
            L.owner(bad)

    # ---- element map: which parameter element sits at each flat index
    pid = np.full(L.total, -1, dtype=np.int64)
    ppos = np.full(L.total, -1, dtype=np.int64)
    for i, n in enumerate(numels):
        o = L.offsets[i]
        assert (pid[o:o + n] == -1).all()
        pid[o:o + n] = i
        ppos[o:o + n] = np.arange(n)
    assert (pid >= 0).sum() == sum(numels)

    def check_pieces(lo: int, hi: int) -> None:
        seen = np.zeros(L.total, dtype=np.int64)
        prev = lo
        for p in L.pieces(lo, hi):
            assert p.size > 0 and lo <= p.flat_lo and p.flat_hi <= hi
            assert p.flat_lo >= prev, "pieces not in flat order"
            prev = p.flat_hi
            assert 0 <= p.param_lo < p.param_hi <= numels[p.index]
            assert p.flat_lo == L.offsets[p.index] + p.param_lo
            assert (pid[p.flat_lo:p.flat_hi] == p.index).all()
            seen[p.flat_lo:p.flat_hi] += 1
        want = np.zeros(L.total, dtype=np.int64)
        want[lo:hi] = pid[lo:hi] >= 0
        assert np.array_equal(seen, want), (lo, hi)

    # ---- pieces(lo, hi) exactly tiles the parameter elements inside [lo, hi)
    ranges = [(0, L.total), (0, 0), (L.total, L.total)] + [(c.flat_lo, c.flat_hi) for c in all_chunks[:16]]
    for _ in range(8):
        a, b = sorted(rng.randrange(L.total + 1) for _ in range(2))
        ranges.append((a, b))
    for o, n in zip(L.offsets, numels):  # ranges that start/stop on parameter edges
        ranges.append((o, min(o + n + 1, L.total)))
    for lo, hi in ranges:
        check_pieces(lo, hi)

    # ---- owned_pieces over all ranks rebuilds every parameter element exactly once,
    # each at the shard offset flat_to_shard/chunks give it
    count = np.zeros(L.total, dtype=np.int64)
    for r in range(world):
        used_shard = np.zeros(L.shard_size, dtype=np.int64)
        for p, soff in L.owned_pieces(r):
            assert (owner[p.flat_lo:p.flat_hi] == r).all()
            assert np.array_equal(shard_of[p.flat_lo:p.flat_hi], np.arange(soff, soff + p.size))
            assert (ppos[p.flat_lo:p.flat_hi] == np.arange(p.param_lo, p.param_hi)).all()
            count[p.flat_lo:p.flat_hi] += 1
            used_shard[soff:soff + p.size] += 1
        assert used_shard.max(initial=0) <= 1
    assert np.array_equal(count, (pid >= 0).astype(np.int64))

    # ---- param_blocks: exactly the blocks that hold an element of the parameter
    for i, n in enumerate(numels):
        o = L.offsets[i]
        want = [k for k, (s, e) in enumerate(L.blocks) if n and s < o + n and o < e]
        assert L.param_blocks(i) == want


@pytest.mark.parametrize("at_least", [False, True])
@pytest.mark.parametrize("world", range(1, 18))
def test_layout_properties(world, at_least):
    rng = random.Random(1000 + world)
    layouts = 0
    for _ in range(6):
        numels = random_sizes(rng)
        for align in (1, 4, 16):
            offs = FlatLayout(numels, 1, 1, align)  # just for `used`
            for req in block_requests(rng, offs.used, world, align):
                check_layout(numels, world, req, align, rng, at_least)
                layouts += 1
    assert layouts > 50


def test_balanced_blocks():
    """No block is a short remainder: 10 units of world*align in blocks of 4 units are
    4+3+3 (budget: every block <= 4) or 5+5 (at_least: every block >= 4); the old cut
    4+4+2 left a half-size last block (a 44-element span in blocks of 16: 16+16+12, or
    24+20 with at_least, where it was 16+16+12 with the 12 a remainder). The chunk of the 7.5B GPT's stages 0-2 layout at
    N = 4096 with the 2^28 "auto" bucket is then >= 2^28 / 4096 = 65,536 elements."""
    from zerompi.zero.partition import split_span

    assert split_span(0, 40, 16, 4) == [(0, 16), (16, 28), (28, 40)]
    assert split_span(0, 40, 16, 4, at_least=True) == [(0, 20), (20, 40)]
    assert split_span(8, 20, 16, 4, at_least=True) == [(8, 20)]   # shorter than the bucket
    assert split_span(8, 8, 16, 4) == []
    L = FlatLayout([30, 14], world=2, block=16, align=2)           # T = 44: 3 blocks of 16 before
    assert [e - s for s, e in L.blocks] == [16, 16, 12] and L.block == 16
    L = FlatLayout([30, 14], world=2, block=16, align=2, at_least=True)
    assert [e - s for s, e in L.blocks] == [24, 20] and L.block == 24
    # a span of about 7.5e9 elements (the 7.5B GPT's stages 0-2) at N = 4096, align 16
    span = 114_441 * 65_536
    blocks = split_span(0, span, 1 << 28, 4096 * 16, at_least=True)
    assert min(e - s for s, e in blocks) // 4096 >= 65_536
    assert max(e - s for s, e in blocks) <= (1 << 28) * (1 + 1 / len(blocks)) + 4096 * 16


def test_fixed_cases():
    # One huge parameter over many small blocks, every rank holds a piece of it.
    L = FlatLayout([1, 10_007, 0, 3], world=3, block=50, align=4)
    assert len(L.blocks) > 100 and L.param_blocks(1) == list(range(0, len(L.blocks)))
    assert all(any(p.index == 1 for p, _ in L.owned_pieces(r)) for r in range(3))
    # No parameters at all: one padding-only block.
    E = FlatLayout([], world=5, block=1000, align=16)
    assert E.total == 80 and E.blocks == [(0, 80)] and E.shard_size == 16
    assert E.pieces(0, 80) == [] and all(E.owned_pieces(r) == [] for r in range(5))
    # Block larger than the whole buffer collapses to a single block.
    B = FlatLayout([7, 9], world=4, block=10**9, align=1)
    assert B.blocks == [(0, 16)] and B.block == 16


def test_invalid_arguments():
    with pytest.raises(ValueError):
        FlatLayout([1], world=0, block=4)
    with pytest.raises(ValueError):
        FlatLayout([1], world=2, block=4, align=0)
    with pytest.raises(ValueError):
        FlatLayout([3, -1], world=2, block=4)
    L = FlatLayout([5], world=2, block=4)
    for r in (-1, 2):
        with pytest.raises(ValueError):
            L.chunks(r)


def test_units_start_on_block_boundaries_and_tile_exactly():
    """Stage 3 layouts: each unit (a module's parameters) owns whole blocks, so gathering
    one unit never fetches a neighbour's elements; ownership stays exact."""
    import random

    from zerompi.zero.partition import FlatLayout, split_span

    rng = random.Random(7)
    for world in (1, 2, 3, 4, 5, 8):
        for _ in range(20):
            counts = [rng.randint(0, 4) for _ in range(rng.randint(1, 6))]
            numels = [rng.choice([0, 1, 7, 13, 64, 1000]) for _ in range(sum(counts))]
            lay = FlatLayout(numels, world, rng.choice([1, 16, 100, 4096]), 4, units=counts,
                             at_least=rng.random() < 0.5)
            assert len(lay.unit_blocks) == len(counts)
            for u, blocks in enumerate(lay.unit_blocks):
                s, e = lay.unit_spans[u]
                assert [lay.blocks[k] for k in blocks] == split_span(s, e, lay.requested, world * 4, lay.at_least)
                for k in blocks:
                    bs, be = lay.blocks[k]
                    assert s <= bs < be <= e and (be - bs) % world == 0
                for i in lay.unit_params[u]:
                    assert s <= lay.offsets[i] and lay.offsets[i] + lay.numels[i] <= e
            owned = [0] * lay.total
            for r in range(world):
                shard = 0
                for ch in lay.chunks(r):
                    assert ch.shard_lo == shard
                    shard += ch.size
                    for f in range(ch.flat_lo, ch.flat_hi):
                        owned[f] += 1
                        assert lay.owner(f) == r and lay.flat_to_shard(f) == ch.shard_lo + f - ch.flat_lo
                assert shard == lay.shard_size
            assert owned == [1] * lay.total
            seen = [0] * sum(numels)
            for r in range(world):
                for pc, _ in lay.owned_pieces(r):
                    base = sum(numels[:pc.index])
                    for j in range(pc.param_lo, pc.param_hi):
                        seen[base + j] += 1
            assert seen == [1] * sum(numels)
