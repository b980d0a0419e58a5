"""Dry run: the engine's own partition layout at N virtual ranks, without MPI, data or
parameter memory.

What runs is the engine's own builder (zero/layout.py): the model is built on the `meta`
device, the stage's parameter store plans the flat order and stage-3 units, a FlatLayout
lays it out over N ranks, and a ShardState on the `meta` placement is built for sampled
ranks; its `memory_report()` is what `engine.memory_report()` returns on that rank.

Nothing is done per rank for all N ranks except one numpy array of N padding counts:
every block splits into N equal chunks (so every rank owns exactly T / N elements), and
the padding (alignment gaps between parameters, the tail of each unit) is walked gap by
gap, which gives every rank's real-parameter count exactly. `layout.pieces` over a
rank's chunks then recounts it independently for a few ranks (named in the output).
"""
from __future__ import annotations

import dataclasses
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from ..config import ZeroConfig
from ..device import Placement
from ..precision import DTYPES, reduce_dtype_of
from ..zero import layout as zlayout
from ..zero.layout import PARTS
from ..zero.params import Plan
from ..zero.partition import Chunk, FlatLayout
from .activations import comm_buffer_bytes
from .memory import model_states
from .models import ModelSpec, meta_model


@dataclass
class Built:
    """The engine's layout for one (model, N, stage kind)."""

    n: int
    layout: FlatLayout
    plan: Plan
    numels: list[int]
    seconds: float                                 # plan + FlatLayout constructor
    bucket: int = 0                                # bucket_policy's bucket (elements)
    balance: dict | None = None                    # balance(): computed once per layout
    _chunks: dict = field(default_factory=dict)

    def chunks(self, rank: int) -> list[Chunk]:
        """layout.chunks(rank), kept for the few sampled ranks (stages 1-2 share them)."""
        if rank not in self._chunks:
            self._chunks[rank] = self.layout.chunks(rank)
        return self._chunks[rank]

    def all_chunks(self) -> list[Chunk]:
        """Stage 0's `own`: every block, shard index = flat index (zero/layout.owned)."""
        if "all" not in self._chunks:
            self._chunks["all"] = zlayout.owned(self.layout, 0, 0)
        return self._chunks["all"]


class DryRun:
    """Builds (and caches) layouts of one model for any N and stage."""

    def __init__(self, spec: ModelSpec, zcfg: ZeroConfig | None = None, tp: int = 1, device: str = "cpu"):
        # device: where the planned run's buffers live ("auto" buckets have a larger
        # floor on a GPU: zero/buckets.py)
        self.spec, self.zcfg, self.tp, self.device = spec, zcfg or ZeroConfig(), tp, device
        t = time.perf_counter()
        self.model = meta_model(spec, tp)  # with tp > 1: one tp rank's share, what its engine lays out
        self.trainable = [(n, p) for n, p in self.model.named_parameters(remove_duplicate=True)
                          if p.requires_grad]
        self.meta_seconds = time.perf_counter() - t
        stored = sum(p.untyped_storage().nbytes() for _, p in self.trainable if p.device.type != "meta")
        if stored:  # the estimator must never materialise a model
            raise RuntimeError(f"meta model holds {stored} bytes of parameter storage")
        self._cache: dict = {}

    def build(self, n: int, stage: int, bucket: "int | str | tuple[int, bool] | None" = None,
              precision: str | None = None, k: int | None = None) -> Built:
        """The layout the engine builds at N ranks for `stage` (bucket: override
        zero.bucket_size; a pair (elements, at_least) is taken as resolved; precision:
        override zero.precision, which sizes "auto"; k: ranks per shard group,
        zero.shard_group, default N: the layout spans k ranks, replicated N / k times)."""
        if n < 1:
            raise ValueError(f"N must be >= 1, got {n}")
        k = n if k is None else k
        cfg = self.zcfg if bucket is None or isinstance(bucket, tuple) else \
            dataclasses.replace(self.zcfg, bucket_size=bucket)
        # the engine's own builder (zero/layout.py): "auto" grows with N
        bucket, at_least = bucket if isinstance(bucket, tuple) else zlayout.bucket(cfg, n, stage, precision,
                                                                                      device=self.device)
        key = (n, k, PARTS[stage].store, bucket, at_least)
        if key not in self._cache:
            t = time.perf_counter()
            plan = zlayout.plan(self.model, self.trainable, cfg, stage, bucket, at_least)
            layout = zlayout.flat_layout(plan, k, cfg, bucket, at_least, n // k)
            numels = [p.numel() for _, p in plan.order]
            built = Built(n, layout, plan, numels, time.perf_counter() - t, bucket)
            self._cache[key] = built
        return self._cache[key]


# ------------------------------------------------------------------ per-rank memory
def rank_state(built: Built, stage: int, rank: int, precision: str, grad_accum_dtype: str) -> dict:
    """memory_report() of a ShardState for `rank`, built exactly as the engine builds it,
    on the meta placement (no memory)."""
    own = built.all_chunks() if PARTS[stage].owns_all else built.chunks(rank)
    st = zlayout.shard_state(built.layout, own, Placement.of("meta"), stage, precision, grad_accum_dtype)
    rep = st.memory_report()
    rep["owned"] = st.owned
    return rep


def padding_per_rank(layout: FlatLayout) -> np.ndarray:
    """Elements of each rank's shard that belong to no parameter, for all N ranks: walk
    every gap of the flat space (alignment gaps, unit tails) and split it over the
    chunks it falls in."""
    n = layout.world
    pad = np.zeros(n, dtype=np.int64)
    covered = sorted((o, o + k) for o, k in zip(layout.offsets, layout.numels) if k)
    gaps, pos = [], 0
    for a, b in covered:
        if a > pos:
            gaps.append((pos, a))
        pos = max(pos, b)
    if pos < layout.total:
        gaps.append((pos, layout.total))
    for a, b in gaps:
        while a < b:
            k = layout.block_of(a)
            s, e = layout.blocks[k]
            c = (e - s) // n
            hi = min(b, e)
            r0, r1 = (a - s) // c, (hi - 1 - s) // c
            if r0 == r1:
                pad[r0] += hi - a
            else:
                pad[r0] += s + (r0 + 1) * c - a
                pad[r0 + 1:r1] += c
                pad[r1] += hi - (s + r1 * c)
            a = hi
    return pad


def real_elements(built: Built, rank: int) -> int:
    """Parameter elements `rank` owns, counted from the layout's own pieces of each of its
    chunks (what layout.owned_pieces(rank) walks)."""
    pieces = built.layout.pieces
    return sum(p.size for ch in built.chunks(rank) for p in pieces(ch.flat_lo, ch.flat_hi))


# ------------------------------------------------------------------ collectives per step
def reduce_bytes(zcfg: ZeroConfig, precision: str) -> int:
    """Bytes per element of the gradient reduction (engine: GradReducer's reduce_dtype)."""
    return reduce_dtype_of(precision, zcfg.reduce_dtype).itemsize


def collectives(built: Built, stage: int, zcfg: ZeroConfig, precision: str, gas: int = 1) -> list[dict]:
    """Every collective of one optimizer step (GAS micro-steps) as rows grouped by buffer
    size: op, elements per collective, per-rank chunk, bytes, count per step, and the
    elements per step in comm_stats()'s convention (all-reduce of n counts 2n)."""
    layout, n, g = built.layout, built.layout.world, built.layout.replicas
    if layout.alone:  # one data-parallel rank: nothing to reduce, gather or agree on
        return []
    pbytes, rbytes = DTYPES[precision].itemsize, reduce_bytes(zcfg, precision)
    sizes = [e - s for s, e in layout.blocks]
    all_blocks = Counter(sizes)
    reduce_times = gas if PARTS[stage].reduction == "scatter_per_bucket" else 1
    rows: list[tuple[str, int, int, int, bool]] = []   # (op, elements, element bytes, count, scalars)
    if stage == 0:
        rows += [("all_reduce", b, rbytes, c, False) for b, c in all_blocks.items()]
    else:
        rows += [("reduce_scatter", b, rbytes, c * reduce_times, False) for b, c in all_blocks.items()]
    if stage and g > 1:  # hybrid: each rank's chunk all-reduced across the g groups (comm.hierarchy)
        rows += [("all_reduce", b // n, rbytes, c * reduce_times, False) for b, c in all_blocks.items()]
    # a shard group of one rank (zero.shard_group 1) gathers nothing: the update wrote the
    # parameters (1-2), the units are views of the shard (3)
    if stage in (1, 2) and n > 1:
        rows += [("all_gather", b, pbytes, c, False) for b, c in all_blocks.items()]
    if stage == 3 and n > 1:
        gathers: Counter = Counter()
        for u, blocks in enumerate(layout.unit_blocks):
            if built.plan.unit_persistent[u]:
                per_step = 1                       # refreshed once after the update
            else:                                  # forward + backward, per micro-step
                per_step = gas * 2
            for k in blocks:
                gathers[sizes[k]] += per_step
        rows += [("all_gather", b, pbytes, c, False) for b, c in gathers.items()]
    # the step's small all-reduce: squared norm + one 'used' flag per parameter, float64
    rows.append(("all_reduce", 1 + len(built.numels), 8, 1, True))
    out = []
    for op, elems, eb, count, scalars in sorted(rows, key=lambda r: (r[0], -r[1])):
        counted = 2 * elems if op == "all_reduce" else elems
        per = g if op == "all_reduce" and g > 1 and stage else n  # the replicas split a chunk
        out.append({"op": op, "elements": elems, "chunk_elements": elems if scalars else elems // per,
                    "element_bytes": eb, "nbytes": elems * eb, "count": count,
                    "counted_elements": counted * count, "bytes_per_step": counted * eb * count,
                    "scalars": scalars})
    return out


def collective_summary(rows: list[dict]) -> dict:
    """Collectives per step by op, and the smallest per-rank chunk of a bucket collective,
    per op and overall, in elements and in the op's own bytes (reduce-scatter and stage 0's
    all-reduce in the reduce dtype, all-gather in the param dtype): the same elements are
    fewer bytes in a bf16 all-gather than in an fp32 reduce-scatter."""
    by_op: dict[str, dict] = {}
    for r in rows:
        d = by_op.setdefault(r["op"], {"count": 0, "counted_elements": 0, "bytes": 0,
                                       "smallest_chunk_elements": None, "smallest_chunk_bytes": None})
        d["count"] += r["count"]
        d["counted_elements"] += r["counted_elements"]
        d["bytes"] += r["bytes_per_step"]
        if not r["scalars"]:
            cb = r["chunk_elements"] * r["element_bytes"]
            if d["smallest_chunk_bytes"] is None or cb < d["smallest_chunk_bytes"]:
                d["smallest_chunk_bytes"] = cb
            if d["smallest_chunk_elements"] is None or r["chunk_elements"] < d["smallest_chunk_elements"]:
                d["smallest_chunk_elements"] = r["chunk_elements"]
    bucket_rows = [r for r in rows if not r["scalars"]]
    if not bucket_rows:  # one rank: no collectives
        return {"by_op": by_op, "collectives": 0, "smallest_chunk_elements": 0, "smallest_chunk_bytes": 0,
                "smallest_chunk_op": None, "largest_chunk_elements": 0}
    smallest = min(bucket_rows, key=lambda r: r["chunk_elements"] * r["element_bytes"])
    return {"by_op": by_op, "collectives": sum(d["count"] for d in by_op.values()),
            "smallest_chunk_elements": min(r["chunk_elements"] for r in bucket_rows),
            "smallest_chunk_bytes": smallest["chunk_elements"] * smallest["element_bytes"],
            "smallest_chunk_op": smallest["op"],
            "largest_chunk_elements": max(r["chunk_elements"] for r in bucket_rows)}


# ------------------------------------------------------------------ one dry run
def balance(built: Built, check_ranks: tuple[int, ...] | None = None) -> dict:
    """Real-parameter elements per rank over all N ranks (gap walk), recounted from the
    layout's pieces for `check_ranks` (default: 0, the rank with the most padding, N-1)."""
    if built.balance is not None and check_ranks is None:
        return built.balance
    layout, n = built.layout, built.n
    pad = padding_per_rank(layout)
    real = layout.shard_size - pad
    if int(real.sum()) != sum(built.numels):
        raise AssertionError(f"real elements over all ranks {int(real.sum())} != parameters {sum(built.numels)}")
    ranks = check_ranks if check_ranks is not None else tuple(sorted({0, int(np.argmax(pad)), n - 1}))
    t = time.perf_counter()
    checked = {}
    for r in ranks:
        got = real_elements(built, r)
        if got != int(real[r]):
            raise AssertionError(f"rank {r}: layout pieces give {got} real elements, the gap walk {real[r]}")
        checked[str(r)] = got
    out = {"min": int(real.min()), "max": int(real.max()),
           "min_rank": int(np.argmin(real)), "max_rank": int(np.argmax(real)),
           "imbalance": int(real.max() - real.min()),
           "imbalance_fraction": float((real.max() - real.min()) / real.mean()),
           "padding_max": int(pad.max()), "padding_total": int(pad.sum()),
           "checked_ranks": checked, "check_seconds": time.perf_counter() - t}
    if check_ranks is None:
        built.balance = out
    return out


def dry_run(runner: DryRun, n: int, stage: int, precision: str = "bf16", grad_accum_dtype: str = "param",
            gas: int = 1, check_ranks: tuple[int, ...] | None = None, bucket: int | None = None) -> dict:
    """The engine's layout at N ranks for one stage: per-rank bytes (checked against the
    formula at the padded T), real-element imbalance over all ranks, collectives."""
    t0 = time.perf_counter()
    built = runner.build(n, stage, bucket, precision)
    layout = built.layout
    T, psi = layout.total, sum(built.numels)
    bal = balance(built, check_ranks)
    states = {r: rank_state(built, stage, r, precision, grad_accum_dtype) for r in sorted({0, n - 1})}
    want = model_states(T, n, stage, precision, grad_accum_dtype)
    paper = model_states(psi, n, stage, precision, grad_accum_dtype)
    equal = all(st[k] == want[k] for st in states.values() for k in want)
    rows = collectives(built, stage, runner.zcfg, precision, gas)
    return {
        "N": n, "stage": stage, "precision": precision, "grad_accum_dtype": grad_accum_dtype,
        "bucket_size": runner.zcfg.bucket_size if bucket is None else bucket[0] if isinstance(bucket, tuple) else bucket,
        "bucket": built.bucket, "at_least": layout.at_least, "requested_block": layout.requested,
        "alignment": runner.zcfg.alignment, "gas": gas,
        "params": psi, "padded": T, "padding": T - psi, "blocks": len(layout.blocks),
        "units": len(layout.unit_spans), "block": layout.block,
        "owned_per_rank": T if PARTS[stage].owns_all else layout.shard_size,
        "memory_report": {str(r): st for r, st in states.items()},
        # the reducer's buffers (engine.memory_report()["buffers"]), in the reduce dtype
        "buffers": comm_buffer_bytes(layout, runner.zcfg.bucket_count, reduce_bytes(runner.zcfg, precision)),
        "formula_at_T": want, "formula_at_psi": paper, "equal_formula": equal,
        "real_elements": bal,
        "collectives": rows, "summary": collective_summary(rows),
        "layout_seconds": built.seconds, "seconds": time.perf_counter() - t0,
    }
