"""The hierarchy modes priced: per-rank memory and the bytes one step moves inside and
across nodes, for the engine's own layout and groups (zero/groups.py decide(): the same
decisions the engine takes, from a node map of N ranks, P per node).

Each logical collective of a step becomes the sub-collectives the engine issues, each on
a group of n ranks spanning a nodes with b ranks on each (block placement):

  mode        reduce-scatter (B bytes in)          parameter all-gather (B bytes out)
  flat        alltoall B on all N                  all-gather B on all N
  two-level   alltoall B in the node (P),          all-gather B/P across nodes (M),
              alltoall B/P across nodes (M)        all-gather B in the node
  hybrid      alltoall B in the group (K), then    all-gather B in the group
              c = B/K across the G replicas:
              alltoall c + all-gather c
  secondary   (as its mode)                        backward: all-gather B in the group
                                                   of the secondary partition

Bytes on the wire (summed over every rank of the job, `wire`): an alltoall sends
(n-1)/n x B per rank, (n-b)/n x B of it to other nodes. An all-gather of B bytes (chunk
c = B/n) follows MPICH's choice (measured on the simulated cluster, benchmarks/
bench_hierarchy.py): a ring in communicator order when B >= 512 KiB or n is not a power
of two (n - 1 chunks per rank; a cross-node edges per group when a > 1, each carrying
(n-1) chunks), else recursive doubling (each rank (n-b) chunks across nodes). Each
node's link then carries the job's cross-node bytes / M in each direction. Not counted:
the step's scalar all-reduce and stage 3's agreement rounds (tens of bytes each).

Time (alpha-beta, cost_model.py): each sub-collective on `inter` when its group spans
nodes, else on `intra`; in sequence, no overlap. A flat ring spanning nodes runs at
the inter-node link's pace on every step.
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

# The modes compared by default (zero.* settings).
MODES = {
    "flat": {"shard_group": "world", "hierarchical": "off", "secondary": "off"},
    "two-level": {"shard_group": "world", "hierarchical": "on", "secondary": "off"},
    "hybrid node": {"shard_group": "node", "hierarchical": "auto", "secondary": "off"},
    "secondary": {"shard_group": "world", "hierarchical": "off", "secondary": "node"},
    "secondary + two-level": {"shard_group": "world", "hierarchical": "on", "secondary": "node"},
}


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


def wire(kind: str, nbytes: int, n: int, a: int, b: int, groups: int) -> tuple[float, float]:
    """(bytes crossing nodes, bytes inside nodes) that `groups` groups of n ranks (a nodes
    x b) send for one sub-collective moving a full buffer of `nbytes`."""
    if n <= 1:
        return 0.0, 0.0
    if kind == "alltoall":
        cross, intra = (n - b) / n * nbytes * n, (b - 1) / n * nbytes * n
    else:
        c = nbytes / n
        if nbytes >= RING_MIN_BYTES or n & (n - 1):
            cross = (a if a > 1 else 0) * (n - 1) * c
        else:
            cross = n * (n - b) * c
        intra = n * (n - 1) * c - cross
    return cross * groups, intra * groups


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
    out = []
    for (what, kind, nbytes, group), count in sorted(rows.items()):
        n, a, b = geo[group]
        cross, intra = wire(kind, nbytes, n, a, b, plan.n // n)
        out.append({"what": what, "kind": kind, "nbytes": nbytes, "group": group, "n": n, "nodes": a,
                    "per_node": b, "count": count, "cross_bytes": cross * count, "intra_bytes": intra * count})
    return out


def step_time(rows: list[dict], inter, intra) -> dict:
    total = lat = cross_t = 0.0
    for r in rows:
        link = inter if r["nodes"] > 1 else intra
        op = "all_to_all" if r["kind"] == "alltoall" else "all_gather"
        s, l = cost_model.collective_time(op, r["nbytes"], r["n"], link)
        total += s * r["count"]
        lat += l * r["count"]
        cross_t += s * r["count"] if link is inter else 0.0
    return {"seconds": total, "latency_fraction": lat / total if total else 0.0, "inter_seconds": cross_t}


def price(runner, n: int, per_node: int | None, stage: int, settings: dict, precision: str, gas: int,
          grad_accum_dtype: str, bucket, inter, intra) -> dict:
    """One mode at N ranks: its groups, per-rank memory, traffic per step, time."""
    plan = plan_for(n, per_node, stage, settings["shard_group"], settings["hierarchical"], settings["secondary"])
    built = runner.build(n, stage, bucket, precision, k=plan.k)
    layout, zc = built.layout, runner.zcfg
    T, pb = layout.total, DTYPES[precision].itemsize
    states = model_states(T, plan.k, stage, precision, grad_accum_dtype)
    secondary = 0
    if plan.secondary:
        np_units = sum(e - s for (s, e), p in zip(layout.unit_spans, built.plan.unit_persistent) if not p)
        secondary = np_units // plan.secondary * pb
    buffers = comm_buffer_bytes(layout, zc.bucket_count, reduce_bytes(zc, precision))
    rows = level_rows(built, stage, plan, zc, precision, gas)
    cross = sum(r["cross_bytes"] for r in rows)
    intra_b = sum(r["intra_bytes"] for r in rows)
    return {"N": n, "stage": stage, "ranks_per_node": plan.per_node, "nodes": plan.nodes, "mode": plan.mode,
            "settings": settings, "shard_group": plan.k, "replicas": plan.g, "secondary_group": plan.secondary,
            "padded": T, "model_states": states["model_states"], "secondary_bytes": secondary,
            "buffers": buffers, "per_rank_bytes": states["model_states"] + secondary + buffers,
            "cross_bytes_per_rank": cross / n, "intra_bytes_per_rank": intra_b / n,
            "node_link_bytes": cross / plan.nodes, "cross_bytes_total": cross,
            "time": step_time(rows, inter, intra), "rows": rows}


def render(results: list[dict], inter, intra) -> str:
    """The comparison table (report.py's style)."""
    from .report import gib, pick_unit, secs, table

    uname, unit = pick_unit([d["per_rank_bytes"] for d in results])
    head = ["N", "P", "stage", "mode", "K x G", "states", "secondary", "buffers", f"total {uname}",
            "in node/rank", "across/rank", "per node link", "time", "inter"]
    body = []
    for d in results:
        name = next((k for k, v in MODES.items() if v == d["settings"]), "config")
        body.append([d["N"], d["ranks_per_node"], d["stage"], f"{name} ({d['mode']})",
                     f"{d['shard_group']} x {d['replicas']}", gib(d["model_states"], unit),
                     gib(d["secondary_bytes"], unit) if d["secondary_group"] else "-", gib(d["buffers"], unit),
                     gib(d["per_rank_bytes"], unit), f"{d['intra_bytes_per_rank'] / 2**30:.3g} GiB",
                     f"{d['cross_bytes_per_rank'] / 2**30:.3g} GiB", f"{d['node_link_bytes'] / 2**30:.3g} GiB",
                     secs(d["time"]["seconds"]), f"{d['time']['inter_seconds'] / max(d['time']['seconds'], 1e-30):.0%}"])
    return "\n".join([
        f"Hierarchy modes (zero.shard_group, zero.comm.hierarchical, zero.stage3.secondary_partition); "
        f"links: across nodes {inter.name} ({inter.alpha * 1e6:g} us, {1 / inter.beta / 1e9:.3g} GB/s per rank), "
        f"inside {intra.name} ({intra.alpha * 1e6:g} us, {1 / intra.beta / 1e9:.3g} GB/s).",
        table(head, body),
        "K x G: ranks per shard group x replica groups. states: model states per rank (exact, the engine's "
        "layout at K); secondary: stage-3 node-local copies;",
        "buffers: the reducer's (exact). Bytes per step each rank sends inside its node and across nodes, and "
        "what crosses each node's link each way (the job's cross-node bytes / nodes);",
        "time: alpha-beta, sub-collectives in sequence, no overlap; inter: its share spent on the inter-node "
        "link. docs/scaling.md, \"Hierarchy\"."])
