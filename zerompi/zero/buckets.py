"""Bucket sizing: what `zero.bucket_size = "auto"` resolves to at N ranks, over the
alpha-beta model of the communicators (comm/cost_model.py). The engine, the dry run and
the estimator all size a bucket through `bucket_policy` here."""
from __future__ import annotations

import math

from ..comm.cost_model import DEFAULT_AUTO_LINK, PRESETS, Link, check_n
from ..precision import DTYPES, reduce_dtype_of

# The largest bucket "auto" picks, in bytes of its narrowest collective: 1 GiB, i.e.
# 2^28 elements when every collective moves fp32 and 2^29 (536,870,912, close to
# DeepSpeed's default reduce_bucket_size / allgather_bucket_size of 5e8 elements) when the
# parameters are all-gathered in bf16/fp16. At N = 4096 every chunk is then 256 KiB
# (latency share ~32% on hdr-ib); beyond it, hierarchical (node-then-global) collectives
# are the remedy.
AUTO_CEILING_BYTES = 1 << 30
# The smallest bucket "auto" picks (2^22 elements, the fixed default before "auto"): at
# small N the chunks are large anyway; the bucket is then a memory budget, above it a
# floor on the chunk (bucket_policy below).
AUTO_FLOOR = 1 << 22
# On a GPU the floor is 16x that (2^26 elements, 256 MiB in fp32, about DeepSpeed's
# default buckets' order): every bucket costs a fixed host time (the launches of its copy
# and collective, their events and bookkeeping) whatever its size, and a GPU moves a
# 2^22 bucket in microseconds, so small buckets make the step host-bound (GPT-2 124M had
# 30 buckets a step, a 1B GPT 289). A data-parallel group of one rank has no bucket.
AUTO_FLOOR_GPU = 1 << 26


def auto_bucket_elements(n: int, elem_bytes: int = 4, link: Link | None = None,
                         latency_fraction: float = 0.1, floor: int = AUTO_FLOOR,
                         ceiling_bytes: int | None = AUTO_CEILING_BYTES) -> int:
    """The bucket size (elements) that `bucket_size = "auto"` picks at n ranks.

    elem_bytes: bytes per element of the narrowest collective that moves a bucket
    (auto_elem_bytes below): the same blocks are reduce-scattered in the reduce
    dtype and all-gathered in the param dtype, so a bf16/fp16 run sizes for 2 bytes and
    every collective's chunk, the fp32 reduce-scatter's included, is then >= c*.

    Derivation. A bucket of B bytes is reduce-scattered over n ranks by a ring: n - 1
    steps, each moving one per-rank chunk of c = B / n bytes, so
        T = (n - 1) (alpha + c beta),   latency share s = alpha / (alpha + c beta),
    which does not depend on n. s <= f (latency_fraction) holds when
        c >= c* = alpha (1 - f) / (f beta),
    so the smallest such bucket is B = n c*: it grows linearly with n, and a fixed bucket
    (today's 2^22 elements) makes the chunks, and with them the efficiency, shrink as 1/n.
    The all-gather of the parameters has the same form, so the same c* bounds it.

    Result: chunk = ceil(c* / elem_bytes) rounded up to a multiple of 16 elements (the
    default alignment), bucket = max(floor, n * chunk) (a multiple of n * 16 when above the
    floor; the floor itself is 2^22 elements, a power of two, whatever elem_bytes), then
    min(ceiling_bytes // elem_bytes, ...) when a ceiling is given. n = 1 (nothing to
    communicate) gives the floor.

    With the default link (hdr-ib: alpha = 5 us, beta = 1/25 GB/s, an assumption that
    errs towards latency: MPI's own latency on HDR is 1-2 us) and f = 0.1, c* = 1.125 MB:
    fp32 (elem_bytes 4): 281,264 elements per rank; the floor 2^22 for n <= 14; n = 64:
    18.0 M elements; n >= 955: the ceiling 2^28 (n = 4096: 65,536 elements = 256 KiB).
    bf16/fp16 (elem_bytes 2): 562,512 per rank; the floor for n <= 7; n = 64: 36.0 M;
    n >= 955: the ceiling 2^29 (n = 4096: 131,072 elements = 256 KiB in bf16, 512 KiB
    in an fp32 reduce-scatter). Uncapped, n = 4096 would want 4.3 GiB buckets.

    Memory: this is a trade-off, not free. The gradient reducer keeps `bucket_count` slots
    of about two buckets each (send buffer + alltoall receive space) plus a chunk, in the
    reduce dtype, so with bucket_count = 2 the buffers are ~4 buckets: at the ceiling
    ~4 GiB per rank with fp32 everywhere, ~8 GiB in a bf16 run with fp32 reduction (2^29
    elements x 4 bytes per bucket), ~4 GiB with reduce_dtype = param; far more than the
    7.5B model's stage-3 model states at n = 4096 (16 Psi / n ~ 29 MB). An integer
    bucket_size caps it. ceiling_bytes=None removes the cap; at the cap the latency
    share rises to alpha / (alpha + (ceiling_bytes / n) beta) (`latency_share`).
    Above the floor the bucket is a lower bound on every block (FlatLayout at_least:
    balanced blocks, none a short remainder), so every chunk of a span at least a bucket
    long is >= bucket / n, and the largest block - and the buffers - can exceed the
    bucket by up to 1 / nb of a block, more for coalesced stage-3 units (7.5B GPT at
    n = 4096, bf16: blocks of 1.07 x the bucket at stages 0-2, a four-layer unit of
    1.5 x it at stage 3: 8.6 and 12 GiB of buffers). A stage-3 unit smaller than a
    bucket with no sibling to merge with is still a block of its own, so its chunks can
    fall below c*.
    """
    n = check_n(n)
    if isinstance(elem_bytes, bool) or not isinstance(elem_bytes, int) or elem_bytes < 1:
        raise ValueError(f"elem_bytes = {elem_bytes!r}: must be an integer >= 1")
    if not 0 < latency_fraction < 1:
        raise ValueError(f"latency_fraction = {latency_fraction!r}: must be in (0, 1)")
    if isinstance(floor, bool) or not isinstance(floor, int) or floor < 1:
        raise ValueError(f"floor = {floor!r}: must be an integer >= 1")
    if ceiling_bytes is not None and (isinstance(ceiling_bytes, bool) or not isinstance(ceiling_bytes, int)
                                      or ceiling_bytes // elem_bytes < floor):
        raise ValueError(f"ceiling_bytes = {ceiling_bytes!r}: must be an integer of at least floor x "
                         f"elem_bytes ({floor * elem_bytes}) or None")
    link = PRESETS[DEFAULT_AUTO_LINK] if link is None else link
    if n == 1 or link.alpha == 0:
        bucket = floor
    elif link.beta == 0:
        raise ValueError(f"link {link.name!r} has beta = 0 (infinite bandwidth): no chunk size "
                         "makes its latency share small; give a finite bandwidth")
    else:
        c_bytes = link.alpha * (1 - latency_fraction) / (latency_fraction * link.beta)
        chunk = -(-math.ceil(c_bytes / elem_bytes) // 16) * 16
        bucket = max(floor, n * chunk)
    return bucket if ceiling_bytes is None else min(bucket, ceiling_bytes // elem_bytes)


def auto_elem_bytes(precision: str, reduce_dtype: str, stage: int) -> int:
    """Bytes per element of the narrowest collective that moves a bucket: at stages 1-3
    its blocks are reduce-scattered in the reduce dtype and all-gathered in the param
    dtype, so "auto" sizes for the smaller of the two (2 in bf16/fp16 runs, 4 in fp32)
    and every chunk of either collective reaches the latency target; stage 0 only
    all-reduces gradients (in the reduce dtype). The engine, the dry run and the
    estimator all resolve "auto" through this one function."""
    reduce = reduce_dtype_of(precision, reduce_dtype).itemsize
    return reduce if stage == 0 else min(DTYPES[precision].itemsize, reduce)


def bucket_policy(bucket_size: int | str, world: int, *, elem_bytes: int,
                  link: Link | None = None, device: str = "cpu") -> tuple[int, bool]:
    """(bucket elements, at_least) for FlatLayout. The number's meaning decides which way
    a span's balanced blocks round: an integer bucket_size, and "auto" at its 2^22 floor
    (small N), are memory budgets - every block <= the bucket, so the reducer's buffers
    stay as documented; "auto" above the floor is derived from the per-rank chunk that
    keeps latency small (large N) - every block >= the bucket, so no chunk falls below
    it (buffers grow by at most 1 / nb of a block). Results do not depend on it.
    elem_bytes: auto_elem_bytes of the run (keyword-only, so no caller can leave it out);
    link: the fabric "auto" sizes for (the estimator's --link; default hdr-ib);
    device: where the buffers live ("cuda": the GPU floor AUTO_FLOOR_GPU)."""
    if bucket_size != "auto":
        return int(bucket_size), False
    floor = AUTO_FLOOR_GPU if device == "cuda" else AUTO_FLOOR
    b = auto_bucket_elements(world, elem_bytes=elem_bytes, link=link, floor=floor)
    return b, b > floor

