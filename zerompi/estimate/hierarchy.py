"""What one step moves inside and across nodes, and how long the links take: the
estimator's one model of a run on several nodes (`--ranks-per-node P` or `--nodes K`,
docs/scaling.md). N ranks, P per node, M = N / P nodes, in blocks (node i holds ranks
i*P .. i*P + P - 1: srun's and mpiexec's default). The groups are the engine's own
(zero/groups.py decide(), from the same node map and zero.shard_group,
zero.comm.hierarchical, zero.stage3.secondary_partition), and so is the layout.

Each logical collective of a step becomes the sub-collectives the engine issues on MPI
(comm/mpi.py with the 'ordered' reduce-scatter, comm/hierarchy.py), each on a group of n
ranks spanning a nodes with b ranks on each:

  mode        reduce-scatter (B bytes in)          parameter all-gather (B bytes out)
  flat        alltoall B on all N                  all-gather B on all N
  two-level   alltoall B in the node (P),          all-gather B/P across nodes (M),
              alltoall B/P across nodes (M)        all-gather B in the node
  hybrid      alltoall B in the group (K), then    all-gather B in the group
              c = B/K across the G replicas:
              alltoall c + all-gather c
  secondary   (as its mode)                        backward: all-gather B in the group
                                                   of the secondary partition

Stage 0's bucket all-reduce is an alltoall then an all-gather of the sums, on all N ranks
(every mode); the step's scalar all-reduce (squared norm + a flag per parameter, float64)
runs on all N ranks too.

Bytes on the wire (`wire`, per group). An alltoall sends (n-1)/n x B per rank, (n-b)/n x
B of it to other nodes (any algorithm). An all-gather of B bytes (chunk c = B/n) is what
pip MPICH (5.0.2) runs: recursive doubling when B < 512 KiB and n is a power of two
(MPIR_CVAR_ALLGATHER_LONG_MSG_SIZE; the steps at distance >= b cross: each rank sends
(n-b) chunks across), else a ring in communicator order (a ring edges leave the nodes,
each carrying n-1 chunks; one rank per node sends them). The scalar all-reduce is a
tree (reduce-scatter + all-gather by recursive halving and doubling): twice the
all-gather's bytes. Measured on 2 simulated nodes x 2 ranks (veth counters; benchmarks/
bench_nodes.py): an 8 MiB alltoall 2.0 x B across nodes, a
ring all-gather 1.5 x B, a 64 KiB all-gather 2.0 x B, whole steps of every mode within
0.4% (the rest: TCP/IP headers, stage 3's agreement rounds, left out here). Every node
sends the same (block placement): each node's link carries the job's bytes across / M
in each direction.

Time (alpha-beta, cost_model.py), sub-collectives in sequence, no overlap. A
sub-collective inside one node runs on `intra` (cost_model.collective_time). One that
spans nodes runs at `inter`'s pace on every step: steps x alpha + beta x the larger of
the bytes its busiest rank sends across and the bytes across each node's link / Q, Q the
node's inter-node links (NICs) of `inter`'s bandwidth. Q = P (one per rank, the presets'
reading, default) gives a ring spanning nodes (n-1)/n B beta and a two-level level
(M-1)/M B/P beta; Q = 1 (one link per node, shared by its ranks: Ethernet, the simulated
cluster) gives the node's bytes x beta. Traffic inside a node is not charged while a
collective also crosses: the slower link sets the pace.
"""
from __future__ import annotations

from collections import Counter

from ..comm import cost_model
from ..config import ZeroConfig
from ..precision import DTYPES
from ..zero.groups import GroupPlan, decide
from ..zero.layout import PARTS
from .activations import comm_buffer_bytes
from .dryrun import reduce_bytes
from .memory import model_states

RING_MIN_BYTES = 524288  # MPICH's MPIR_CVAR_ALLGATHER_LONG_MSG_SIZE: ring at and above it
SCALAR_BYTES = 8         # the step's scalar all-reduce is float64

# The modes compared (zero.* settings), besides the run's own.
MODES = {
    "flat": {"shard_group": "world", "hierarchical": "off", "secondary": "off"},
    "two-level": {"shard_group": "world", "hierarchical": "on", "secondary": "off"},
    "hybrid node": {"shard_group": "node", "hierarchical": "auto", "secondary": "off"},
    "secondary": {"shard_group": "world", "hierarchical": "off", "secondary": "node"},
    "secondary + two-level": {"shard_group": "world", "hierarchical": "on", "secondary": "node"},
}
DEFAULTS = {"shard_group": "world", "hierarchical": "auto", "secondary": "off"}  # ZeroConfig's
OPS = {"alltoall": "all_to_all", "allgather": "all_gather", "allreduce": "all_reduce"}


def settings_of(zcfg: ZeroConfig) -> dict:
    """The three keys that choose a mode, from a config."""
    return {"shard_group": zcfg.shard_group, "hierarchical": zcfg.comm.hierarchical,
            "secondary": zcfg.stage3.secondary_partition}


def label(settings: dict) -> str:
    """A mode's name in MODES, else its settings."""
    name = next((k for k, v in MODES.items() if v == settings), None)
    return name or ", ".join(f"{k} {v}" for k, v in settings.items() if v != DEFAULTS[k]) or "defaults"


def plan_for(n: int, per_node: int | None, stage: int, shard_group="world", hierarchical="auto",
             secondary="off") -> GroupPlan:
    """The engine's groups for N ranks on nodes of `per_node` (None: one node)."""
    p = per_node or n
    if n % p:
        raise ValueError(f"--ranks-per-node {p} does not divide N = {n}")
    return decide([r // p for r in range(n)], shard_group, hierarchical, secondary, stage)


def geometry(plan: GroupPlan) -> dict[str, tuple[int, int, int]]:
    """(n, nodes spanned a, ranks per node b) of every group the plan's collectives use."""
    N, P, M, K = plan.n, plan.per_node or plan.n, plan.nodes, plan.k
    out = {"world": (N, M, P), "intra": (P, 1, P), "cross": (M, M, 1)}
    if plan.by_node or K >= P:
        out["shard"] = (K, max(1, K // P), min(K, P))
        out["replica"] = (plan.g, plan.g, 1)
    else:
        out["shard"] = (K, 1, K)
        out["replica"] = (plan.g, M, P // K)
    s = plan.secondary
    if s:
        out["secondary"] = (s, max(1, s // P), min(s, P))
    return out


def _pof2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def algorithm(kind: str, nbytes: float, n: int) -> str:
    """cost_model's name for what MPICH runs: alltoall 'ring' (pairwise exchange); an
    all-gather 'tree' (recursive doubling) below RING_MIN_BYTES at a power of two, else
    'ring'; the scalar all-reduce 'tree'."""
    if kind == "alltoall":
        return "ring"
    if kind == "allreduce":
        return "tree"
    return "tree" if nbytes < RING_MIN_BYTES and _pof2(n) else "ring"


def wire(kind: str, nbytes: float, n: int, a: int, b: int) -> tuple[float, float, float]:
    """(bytes crossing nodes, bytes inside nodes, the most one rank sends across) of one
    group of n ranks (a nodes x b) in one sub-collective moving a full buffer of `nbytes`."""
    if n <= 1:
        return 0.0, 0.0, 0.0
    if kind == "alltoall":
        rank = (n - b) / n * nbytes
        return rank * n, (b - 1) / n * nbytes * n, rank
    if kind not in ("allgather", "allreduce"):
        raise ValueError(f"kind {kind!r}: alltoall, allgather or allreduce")
    c = nbytes / n
    if (algorithm("allgather", nbytes, n) == "tree" or kind == "allreduce") and _pof2(n) and _pof2(b):
        rank = (n - b) * c            # recursive doubling: distances b, 2b, .. n/2 cross
        cross = n * rank
    else:
        rank = (n - 1) * c if a > 1 else 0.0  # ring: a edges leave the nodes
        cross = a * rank
    intra = n * (n - 1) * c - cross
    k = 2 if kind == "allreduce" else 1      # tree all-reduce: halving + doubling
    return k * cross, k * intra, k * rank


def level_rows(built, stage: int, plan: GroupPlan, zcfg: ZeroConfig, precision: str, gas: int = 1) -> list[dict]:
    """Every sub-collective of one optimizer step, grouped by buffer size and group."""
    layout = built.layout
    pb, rb = DTYPES[precision].itemsize, reduce_bytes(zcfg, precision)
    geo = geometry(plan)
    sizes = [e - s for s, e in layout.blocks]
    blocks = Counter(sizes)
    times = gas if PARTS[stage].reduction == "scatter_per_bucket" else 1
    rows: Counter = Counter()

    def add(what, kind, nbytes, group, count):
        rows[(what, kind, int(nbytes), group)] += count

    for el, c in blocks.items():
        B = el * rb
        if stage == 0 or plan.mode == "flat":
            add("reduce", "alltoall", B, "world", c * times)
            if stage == 0:
                add("reduce", "allgather", B, "world", c)
        elif plan.mode == "two-level":
            add("reduce", "alltoall", B, "intra", c * times)
            add("reduce", "alltoall", B // plan.per_node, "cross", c * times)
        else:
            add("reduce", "alltoall", B, "shard", c * times)
            add("reduce (replicas)", "alltoall", B // plan.k, "replica", c * times)
            add("reduce (replicas)", "allgather", B // plan.k, "replica", c * times)
    gathers: Counter = Counter()  # (elements, backward?) -> count
    if stage in (1, 2):
        for el, c in blocks.items():
            gathers[(el, False)] += c
    if stage == 3:
        for u, ks in enumerate(layout.unit_blocks):
            persistent = built.plan.unit_persistent[u]
            for k in ks:
                gathers[(sizes[k], False)] += 1 if persistent else gas
                if not persistent:
                    gathers[(sizes[k], True)] += gas
    for (el, backward), c in gathers.items():
        B = el * pb
        if backward and plan.secondary:
            add("gather (backward)", "allgather", B, "secondary", c)
        elif plan.mode == "two-level":
            add("gather", "allgather", B // plan.per_node, "cross", c)
            add("gather", "allgather", B, "intra", c)
        else:
            add("gather", "allgather", B, "world" if plan.mode == "flat" else "shard", c)
    add("scalars", "allreduce", (1 + len(built.numels)) * SCALAR_BYTES, "world", 1)
    out = []
    for (what, kind, nbytes, group), count in sorted(rows.items()):
        n, a, b = geo[group]
        cross, intra, rank = wire(kind, nbytes, n, a, b)
        groups = plan.n // n
        out.append({"what": what, "kind": kind, "algo": algorithm(kind, nbytes, n), "nbytes": nbytes,
                    "group": group, "n": n, "nodes": a, "per_node": b, "count": count,
                    "cross_bytes": cross * groups * count, "intra_bytes": intra * groups * count,
                    "node_bytes": cross * groups * count / plan.nodes, "rank_cross_each": rank})
    return out


def step_time(rows: list[dict], inter, intra, nics: int) -> dict:
    """Seconds of the step's sub-collectives in sequence (module docstring); each row
    gets its own 'seconds'."""
    total = lat = cross_t = 0.0
    for r in rows:
        op = OPS[r["kind"]]
        if r["nodes"] > 1:
            steps, _ = cost_model.coefficients(op, r["nbytes"], r["n"], r["algo"])
            node_each = r["node_bytes"] / r["count"] if r["count"] else 0.0
            l_ = steps * inter.alpha
            s = l_ + inter.beta * max(r["rank_cross_each"], node_each / nics)
        else:
            s, l_ = cost_model.collective_time(op, r["nbytes"], r["n"], intra, r["algo"])
        r["seconds"] = s * r["count"]
        total += s * r["count"]
        lat += l_ * r["count"]
        cross_t += s * r["count"] if r["nodes"] > 1 else 0.0
    return {"seconds": total, "latency_seconds": lat, "latency_fraction": lat / total if total else 0.0,
            "inter_seconds": cross_t}


def secondary_bytes(built, plan: GroupPlan, precision: str) -> int:
    """Stage 3's node-local copies of the non-persistent units (zero/stage3/secondary.py)."""
    if not plan.secondary:
        return 0
    layout = built.layout
    np_units = sum(e - s for (s, e), p in zip(layout.unit_spans, built.plan.unit_persistent) if not p)
    return np_units // plan.secondary * DTYPES[precision].itemsize


def price(runner, n: int, per_node: int | None, stage: int, settings: dict, precision: str, gas: int,
          grad_accum_dtype: str, bucket, inter, intra, nics: int | None = None) -> dict:
    """One mode at N ranks: its groups, per-rank memory, traffic per step, time. nics:
    inter-node links per node (default one per rank)."""
    plan = plan_for(n, per_node, stage, settings["shard_group"], settings["hierarchical"], settings["secondary"])
    nics = nics or plan.per_node or n
    built = runner.build(n, stage, bucket, precision, k=plan.k)
    layout, zc = built.layout, runner.zcfg
    states = model_states(layout.total, plan.k, stage, precision, grad_accum_dtype)
    secondary = secondary_bytes(built, plan, precision)
    buffers = comm_buffer_bytes(layout, zc.bucket_count, reduce_bytes(zc, precision))
    rows = level_rows(built, stage, plan, zc, precision, gas)
    cross = sum(r["cross_bytes"] for r in rows)
    intra_b = sum(r["intra_bytes"] for r in rows)
    return {"N": n, "stage": stage, "ranks_per_node": plan.per_node, "nodes": plan.nodes, "mode": plan.mode,
            "settings": dict(settings), "name": label(settings), "shard_group": plan.k, "replicas": plan.g,
            "secondary_group": plan.secondary, "nics_per_node": nics,
            "padded": layout.total, "model_states": states["model_states"], "secondary_bytes": secondary,
            "buffers": buffers, "per_rank_bytes": states["model_states"] + secondary + buffers,
            "cross_bytes_per_rank": cross / n, "intra_bytes_per_rank": intra_b / n,
            "node_link_bytes": cross / plan.nodes, "cross_bytes_total": cross,
            "time": step_time(rows, inter, intra, nics), "rows": rows}


def compare(runner, n: int, per_node: int | None, stage: int, own: dict, precision: str, gas: int,
            grad_accum_dtype: str, bucket, inter, intra, nics: int | None = None,
            modes: dict | None = None) -> tuple[dict, list[dict]]:
    """The run's own mode (`own` settings) priced, and every mode of `modes` (default
    MODES) whose groups differ, each once, in order; the run's own comes last when none
    of them has its groups. Rows with the run's groups are marked "own"."""
    args = (precision, gas, grad_accum_dtype, bucket, inter, intra, nics)

    def key(settings):
        p = plan_for(n, per_node, stage, settings["shard_group"], settings["hierarchical"], settings["secondary"])
        return p.mode, p.k, p.secondary

    mine = price(runner, n, per_node, stage, own, *args)
    out, seen = [], set()
    for settings in (MODES if modes is None else modes).values():
        if key(settings) not in seen:
            seen.add(key(settings))
            out.append(price(runner, n, per_node, stage, settings, *args))
    for d in out:
        d["own"] = key(d["settings"]) == key(own)
        if d["own"]:
            mine["name"] = d["name"]
    if not any(d["own"] for d in out):
        out.append(dict(mine, own=True))
    return mine, out
