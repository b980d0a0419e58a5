"""The alpha-beta (latency-bandwidth) cost model of collectives (bucket sizes built on it:
zero/buckets.py).

A collective is a sequence of message steps; a step that moves m bytes costs
alpha + m * beta (alpha: seconds per step, beta: seconds per byte on one rank's link).
With B = the full buffer in bytes (reduce_scatter input, all_gather output, all_reduce
buffer, broadcast buffer, all_to_all send buffer) and n ranks, the cost of each op is
(Thakur, Rabenseifner & Gropp, "Optimization of collective communication operations in
MPICH", IJHPCA 2005, whose names for the algorithms are used here):

  algo="ring" (bandwidth-optimal; n - 1 steps per phase)
    reduce_scatter  (n-1) a + (n-1)/n B b      ring / pairwise exchange
    all_gather      (n-1) a + (n-1)/n B b      ring
    all_reduce      2 (n-1) a + 2 (n-1)/n B b  reduce_scatter + all_gather
    broadcast       (lg n + n-1) a + 2 (n-1)/n B b   scatter + ring all_gather (van de Geijn)
    all_to_all      (n-1) a + (n-1)/n B b      pairwise exchange
  algo="tree" (lg n = ceil(log2 n) steps per phase)
    reduce_scatter  lg n a + (n-1)/n B b       recursive halving
    all_gather      lg n a + (n-1)/n B b       recursive doubling
    all_reduce      2 lg n a + 2 (n-1)/n B b   Rabenseifner (halving + doubling); a pipelined
                                               (double binary) tree has the same form
    broadcast       lg n (a + B b)             binomial tree
    all_to_all      not defined (ValueError)

n = 1 costs nothing. The latency part of a cost is its alpha term. Computation inside a
collective (the sum of a reduce-scatter) is not a separate term: it is proportional to the
bytes, so a fitted beta includes it (see `fit`). zerompi's 'ordered' reduce-scatter is an
alltoall (pairwise exchange) followed by a local sum of n - 1 received chunks, i.e. the ring
form above with beta = wire + summation cost per byte.

Presets (`PRESETS`): the non-calibrated ones are assumptions from published figures, not
measurements; pass --alpha/--beta (or `Link(...)`) for your fabric.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

OPS = ("reduce_scatter", "all_gather", "all_reduce", "broadcast", "all_to_all")
ALGOS = ("ring", "tree")


@dataclass(frozen=True)
class Link:
    """One rank's link as the alpha-beta model sees it."""

    name: str
    alpha: float  # seconds per message step (latency, software + wire)
    beta: float   # seconds per byte (1 / bandwidth per rank and direction)

    def __post_init__(self) -> None:
        if not (isinstance(self.alpha, (int, float)) and math.isfinite(self.alpha) and self.alpha >= 0):
            raise ValueError(f"alpha = {self.alpha!r}: must be a finite number >= 0 (seconds per step)")
        if not (isinstance(self.beta, (int, float)) and math.isfinite(self.beta) and self.beta >= 0):
            raise ValueError(f"beta = {self.beta!r}: must be a finite number >= 0 (seconds per byte)")

    @property
    def bandwidth(self) -> float:
        """Bytes per second (inf when beta is 0)."""
        return math.inf if self.beta == 0 else 1.0 / self.beta


# Assumptions (published figures, not measured here):
# - alpha per ring step. MPI point-to-point latency is ~1-2 us on HDR/NDR InfiniBand and
#   < 1 us in shared memory for small messages; a collective step on large messages adds
#   a rendezvous handshake and software. NCCL's own tuning model (src/graph/tuning.cc,
#   hwLat) charges per ring step 2.7 us (LL) to 9.6 us (Simple) over the network and
#   0.47-3.4 us over NVLink. We take 5 us for IB (between MPI's and NCCL-Simple's), 2 us
#   for NVLink and 1 us for shared memory.
# - beta. HDR 200 Gb/s = 25 GB/s per port, NDR 400 Gb/s = 50 GB/s per port (one NIC per
#   rank, line rate, no protocol overhead); NVLink 4 on H100 SXM: 18 links x 25 GB/s =
#   450 GB/s per direction per GPU; shared memory: a copy through a shared buffer at
#   ~10 GB/s per rank (one core's memcpy bandwidth, order of magnitude).
# - calibrated-vm: fitted, not assumed: benchmarks/calibrate_comm.py (deleted; in commit
#   fc0676f) on a 2-core VM over pip MPICH's shared memory, one link fitted jointly to the
#   engine's ordered reduce-scatter and all-gather at N = 2 (the machine, the fit at N = 4,
#   per-op links and the check against real stage-2 steps: docs/scaling.md,
#   benchmarks/results/).
PRESETS: dict[str, Link] = {
    "shm": Link("shm", alpha=1e-6, beta=1 / 10e9),
    "nvlink": Link("nvlink", alpha=2e-6, beta=1 / 450e9),
    "hdr-ib": Link("hdr-ib", alpha=5e-6, beta=1 / 25e9),
    "ndr-ib": Link("ndr-ib", alpha=5e-6, beta=1 / 50e9),
    "calibrated-vm": Link("calibrated-vm", alpha=2.61e-6, beta=0.1771e-9),  # "vm", N = 2, see above
}
DEFAULT_AUTO_LINK = "hdr-ib"


def resolve_link(preset: str | None = None, alpha: float | None = None,
                 beta: float | None = None) -> Link:
    """A named preset, optionally with alpha and/or beta overridden; or, without a preset,
    both alpha and beta (a custom link)."""
    if preset is not None:
        if preset not in PRESETS:
            raise ValueError(f"preset {preset!r}: one of {', '.join(PRESETS)}")
        base = PRESETS[preset]
        return Link(base.name if alpha is None and beta is None else f"{base.name}+custom",
                    base.alpha if alpha is None else float(alpha),
                    base.beta if beta is None else float(beta))
    if alpha is None or beta is None:
        raise ValueError("alpha and beta: give both, or a preset "
                         f"({', '.join(PRESETS)})")
    return Link("custom", float(alpha), float(beta))


def check_n(n) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n = {n!r}: the number of ranks must be an integer >= 1")
    return n


def _lg(n: int) -> int:
    return (n - 1).bit_length()  # ceil(log2 n) for n >= 1


def coefficients(op: str, nbytes: int, n: int, algo: str = "ring") -> tuple[float, float]:
    """(steps, bytes) with time = steps * alpha + bytes * beta for one collective: the
    model is linear in alpha and beta, which is what `fit` solves for."""
    if op not in OPS:
        raise ValueError(f"op {op!r}: one of {', '.join(OPS)}")
    if algo not in ALGOS:
        raise ValueError(f"algo {algo!r}: one of {', '.join(ALGOS)}")
    n = check_n(n)
    if isinstance(nbytes, bool) or not isinstance(nbytes, (int, float)) or not nbytes >= 0 \
            or not math.isfinite(nbytes):
        raise ValueError(f"nbytes = {nbytes!r}: must be a finite number of bytes >= 0")
    if algo == "tree" and op == "all_to_all":
        raise ValueError("algo 'tree' is not defined for all_to_all (use 'ring': pairwise exchange)")
    if n == 1:
        return 0.0, 0.0
    part = (n - 1) / n * nbytes  # what each rank sends (or receives) in one bandwidth phase
    lg = _lg(n)
    if algo == "ring":
        return {"reduce_scatter": (n - 1, part), "all_gather": (n - 1, part),
                "all_reduce": (2 * (n - 1), 2 * part), "broadcast": (lg + n - 1, 2 * part),
                "all_to_all": (n - 1, part)}[op]
    return {"reduce_scatter": (lg, part), "all_gather": (lg, part),
            "all_reduce": (2 * lg, 2 * part), "broadcast": (lg, lg * nbytes)}[op]


def collective_time(op: str, nbytes: int, n: int, link: Link, algo: str = "ring") -> tuple[float, float]:
    """(seconds, latency seconds) of one collective on `link`; see the module docstring
    for the formulas. nbytes is the full buffer (reduce_scatter input, all_gather output,
    all_reduce buffer)."""
    steps, moved = coefficients(op, nbytes, n, algo)
    lat = steps * link.alpha
    return lat + moved * link.beta, lat


def step_comm_time(collectives: Iterable[Sequence], n: int, link: Link, algo: str = "ring") -> dict:
    """Communication time of one training step, issued one collective after another (no
    overlap with each other; overlap with compute is the caller's business).

    collectives: rows (op, nbytes_each, count), optionally a 4th element, the row's own
    algo (e.g. "tree" for a small all-reduce of scalars), overriding `algo`.
    Returns {"seconds", "latency_seconds", "latency_fraction" (of seconds, 0 when there is
    nothing to move), "by_op": {op: seconds}}."""
    total = lat = 0.0
    by_op: dict[str, float] = {}
    for row in collectives:
        if len(row) not in (3, 4):
            raise ValueError(f"collectives row {row!r}: (op, nbytes_each, count[, algo])")
        op, nbytes, count = row[0], row[1], row[2]
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"count = {count!r} in row {row!r}: must be an integer >= 0")
        s, l = collective_time(op, nbytes, n, link, row[3] if len(row) == 4 else algo)
        total += count * s
        lat += count * l
        by_op[op] = by_op.get(op, 0.0) + count * s
    return {"seconds": total, "latency_seconds": lat,
            "latency_fraction": lat / total if total > 0 else 0.0, "by_op": by_op}


def latency_share(chunk_bytes: float, link: Link) -> float:
    """Latency share of each step of a ring collective whose per-rank chunk is chunk_bytes:
    alpha / (alpha + chunk_bytes * beta) (the same for every n >= 2)."""
    d = link.alpha + chunk_bytes * link.beta
    return link.alpha / d if d > 0 else 0.0


def fit(samples: Iterable[Sequence], name: str = "fitted", algo: str = "ring") -> Link:
    """Least-squares alpha and beta from measured collectives.

    samples: rows (op, nbytes, n, seconds[, algo]) with nbytes as in `collective_time`
    (e.g. a timed reduce-scatter of a 4 MiB fp32 buffer at n = 4:
    ("reduce_scatter", 4 << 20, 4, 0.0031)). Each row gives one linear equation
    steps * alpha + bytes * beta = seconds (`coefficients`); the rows are weighted by
    1 / seconds, i.e. the fit minimises the sum of squared *relative* errors, so that
    2^10-element and 2^24-element messages count alike. alpha, beta >= 0: when the
    unconstrained solution has a negative coefficient, that coefficient is 0 and the other
    is fitted alone. Whatever the op costs beyond the wire (the sum of a reduce-scatter,
    copies) is absorbed into beta, because it is proportional to the bytes too.
    """
    rows = []
    for s in samples:
        if len(s) not in (4, 5):
            raise ValueError(f"sample {s!r}: (op, nbytes, n, seconds[, algo])")
        a, b = coefficients(s[0], s[1], s[2], s[4] if len(s) == 5 else algo)
        t = float(s[3])
        if not t > 0:
            raise ValueError(f"sample {s!r}: seconds must be > 0")
        if a == 0 and b == 0:
            continue  # n = 1: nothing to learn
        rows.append((a / t, b / t, 1.0))  # weighted: (a/t) alpha + (b/t) beta ~ 1
    if len(rows) < 2:
        raise ValueError("samples: need at least two samples with n >= 2")
    saa = sum(a * a for a, _, _ in rows)
    sbb = sum(b * b for _, b, _ in rows)
    sab = sum(a * b for a, b, _ in rows)
    say = sum(a * y for a, _, y in rows)
    sby = sum(b * y for _, b, y in rows)
    det = saa * sbb - sab * sab
    alpha = beta = -1.0
    if det > 1e-12 * saa * sbb:
        alpha = (say * sbb - sby * sab) / det
        beta = (saa * sby - sab * say) / det
    if alpha < 0 or beta < 0:  # constrained: the better of the two one-parameter fits
        only_a, only_b = max(say / saa, 0.0), max(sby / sbb, 0.0)
        err_a = sum((a * only_a - y) ** 2 for a, _, y in rows)
        err_b = sum((b * only_b - y) ** 2 for _, b, y in rows)
        alpha, beta = (only_a, 0.0) if err_a <= err_b else (0.0, only_b)
    return Link(name, alpha, beta)
