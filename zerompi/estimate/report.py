"""Text rendering of the estimator's results (the --json output is the same data)."""
from __future__ import annotations

from .memory import GB, GiB, STAGE_NAMES, TABLE1_DP, TABLE1_MODELS

STRATEGY_SHORT = {"none": "none", "checkpoint": "ckpt", "checkpoint+Pa": "ckpt+Pa",
                  "checkpoint+Pa+offload": "ckpt+Pa+off"}


def table(header: list[str], rows: list[list], right: set[int] | None = None) -> str:
    """A plain aligned table; columns in `right` (default: all but the first) right-aligned."""
    cells = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    right = set(range(1, len(header))) if right is None else right
    fmt = lambda r: "  ".join(c.rjust(w) if i in right else c.ljust(w)  # noqa: E731
                              for i, (c, w) in enumerate(zip(r, widths))).rstrip()
    line = "  ".join("-" * w for w in widths)
    return "\n".join([fmt(cells[0]), line] + [fmt(r) for r in cells[1:]])


def gib(b: float, unit: int = GiB) -> str:
    v = b / unit
    return f"{v:.3g}" if v < 1000 else f"{v:,.0f}"


def pick_unit(values) -> tuple[str, int]:
    """GiB, or MiB when every value is below 1 GiB (small models)."""
    return ("GiB", GiB) if max(values, default=0) >= GiB else ("MiB", 2**20)


def gb(b: float) -> str:
    v = b / GB
    return f"{v:.4g}" if v < 10000 else f"{v:,.0f}"


def secs(s: float) -> str:
    if s == 0:
        return "0"
    if s < 1e-3:
        return f"{s * 1e6:.3g} us"
    if s < 1:
        return f"{s * 1e3:.3g} ms"
    return f"{s:.3g} s"


def count(x: int) -> str:
    return f"{x:,}"


# ------------------------------------------------------------------ modes
def render_table1(rows: list[dict]) -> str:
    out = ["Table 1 of the ZeRO paper from our formulas: model-state memory per device in GB",
           "(1 GB = 1e9 bytes), mixed-precision Adam (K = 12): P_os = 4Ψ + 12Ψ/N,",
           "P_os+g = 2Ψ + 14Ψ/N, P_os+g+p = 16Ψ/N; rounded as the paper prints (>= 100: whole",
           "GB truncated; 10-100: one decimal; < 10: two decimals).", ""]
    header = ["DP"] + [f"{lab} {s}" for _, lab in TABLE1_MODELS for s in ("P_os", "P_os+g", "P_os+g+p")]
    by = {(r["N"], r["model"]): r for r in rows}
    body = [[n] + [by[(n, lab)][s] for _, lab in TABLE1_MODELS for s in ("P_os", "P_os+g", "P_os+g+p")]
            for n in TABLE1_DP]
    return "\n".join(out) + "\n" + table(header, body, set(range(len(header))))


def render_formulas(res: dict) -> str:
    rows = res["rows"]
    stages = sorted({r["stage"] for r in rows})
    ns = sorted({r["N"] for r in rows})
    by = {(r["N"], r["stage"]): r for r in rows}
    out = [f"Model states per rank: Ψ = {res['psi']:,} parameters"
           + (f" / tp {res['tp']} = {res['psi'] // res['tp']:,} per tp rank" if res["tp"] > 1 else "")
           + f", {res['precision_label']}.",
           "GB = 1e9 bytes (the paper's unit); bytes exact at Ψ (the engine pads Ψ to",
           "T with T - Ψ < N x alignment, per stage-3 unit: --dry-run shows T).", ""]
    header = ["N"] + [f"stage {s} {STAGE_NAMES[s]}" for s in stages]
    formula_row = ["formula"] + [by[(ns[0], s)]["formula"] for s in stages]
    out.append(table(header, [formula_row] + [[n] + [f"{gb(by[(n, s)]['bytes'])} GB" for s in stages]
                                              for n in ns], set(range(len(header)))))
    out.append("")
    out.append(table(header, [[n] + [f"{round(by[(n, s)]['bytes']):,} B" for s in stages] for n in ns],
                     set(range(len(header)))))
    out.append("")
    out.append("Traffic per step (elements, Ψ units): stage 0 all-reduce 2Ψ; stages 1-2 reduce-scatter Ψ + "
               "all-gather Ψ; stage 3 reduce-scatter Ψ + all-gather 2Ψ.")
    return "\n".join(out)


def _fit_cells(d: dict) -> list[str]:
    fit = d.get("fit")
    if not fit or not fit["by_strategy"]:
        return []
    return [str(fit["by_strategy"][k]["micro_batch"]) for k in STRATEGY_SHORT]


def render_sizing(res: dict) -> str:
    runs = res["runs"]
    out = [res["model"], res["settings"], ""]
    has_act = "activations" in runs[0]
    mem = res.get("mem_per_rank")
    uname, unit = pick_unit([d["fixed"] for d in runs])
    g = lambda b: gib(b, unit)  # noqa: E731
    out.append(f"Memory per rank in {uname} ({unit:,} bytes). states = parameters + gradients + fp32 master + "
               "Adam moments at the padded T (exact);")
    out.append("buffers = gradient buckets (exact); work = stage-3 gathered units + transient gradients "
               "(estimate).")
    header = ["N", "stage", "params", "grads", "master+opt", "states", "buffers", "work"]
    if has_act:
        header += ["b", "act none", "act ckpt", "total ckpt"]
    if mem is not None and has_act:
        header += [f"max b: {v}" if i == 0 else v for i, v in enumerate(STRATEGY_SHORT.values())]
    body = []
    for d in runs:
        ms = d["model_states"]
        row = [d["N"], d["stage"], g(ms["params"]), g(ms["grads"]), g(ms["master"] + ms["optimizer"]),
               g(ms["model_states"]), g(d["buffers"]),
               g(d["gathered"] + d["persistent"] + d["transient_grads"] + d["secondary_bytes"])
               if d["work_estimated"] else "n/a"]
        if has_act:
            a = d["activations"]
            row += [d["micro_batch"], g(a["none"]["device"]), g(a["checkpoint"]["device"]),
                    g(a["checkpoint"]["total_device"])]
        if mem is not None and has_act:
            row += _fit_cells(d)
        body.append(row)
    out.append(table(header, body))
    if has_act:
        d = runs[0]
        out.append(f"b = sequences per micro-batch ({d['micro_batch_from']}), {d['seq']} tokens each; "
                   "act = activations (docs/scaling.md: formula).")
        if mem is not None:
            out.append(f"max b: the largest micro-batch whose total fits {gib(mem, unit)} {uname} per rank, for "
                       "activations without checkpointing, with checkpointing, + Pa, + offload (0: does not fit).")
        if any(d["tp"] == 1 for d in runs):
            out.append("At tp = 1, Pa partitions nothing: ckpt+Pa = ckpt.")
    if any(d["shard_group"] < d["N"] for d in runs):
        out.append("states partitioned over shard groups of K ranks (zero.shard_group): " + ", ".join(
            f"N = {d['N']}: K = {d['shard_group']}" for d in runs if d["shard_group"] < d["N"]) + ".")
    if any(d["secondary_bytes"] for d in runs):
        out.append("work includes stage 3's secondary partition (zero.stage3.secondary_partition): " + ", ".join(
            f"N = {d['N']}: {g(d['secondary_bytes'])} {uname}" for d in runs if d["secondary_bytes"]) + ".")
    if not runs[0]["work_estimated"]:
        out.append("work n/a: a bare parameter count has no module structure to estimate it from.")
    if mem is not None and not has_act:
        for d in runs:
            fits = "fit" if d["fit"]["model_states_fit"] else "do NOT fit"
            out.append(f"N = {d['N']}, stage {d['stage']}: states + buffers + work {fits} in {gib(mem, unit)} {uname} "
                       "(no shape given: activations unknown)")
    out.append("")
    out.append(render_buckets(runs))
    out.append("")
    out.append(render_comm(runs))
    if res.get("nodes"):
        out += ["", render_nodes(res["nodes"])]
    if len(runs) <= 2:
        for d in runs:
            out.append("")
            out.append(render_collectives(d))
    else:
        out.append("(Per-collective rows: give one N and stage, or --json.)")
    return "\n".join(out)


def render_comm(runs: list[dict]) -> str:
    ct = runs[0].get("comm_time")
    head = "Communication per optimizer step (GAS micro-steps); elements counted as comm_stats(): " \
           "all-reduce of n = 2n."
    lines = [head]
    if ct:
        lk = ct["link"]
        lines.append(f"Predicted time: alpha-beta model (cost_model.py), link {lk['name']}: alpha = "
                     f"{lk['alpha'] * 1e6:g} us, beta = {lk['beta']:.3g} s/B "
                     f"({(1 / lk['beta'] / 1e9) if lk['beta'] else float('inf'):.3g} GB/s); "
                     "collectives in sequence, no overlap with compute"
                     + ("; every rank on this one link (across nodes: the table \"Across nodes\")."
                        if runs[0].get("nodes") else "."))
    uname, unit = pick_unit([sum(v["bytes"] for v in d["summary"]["by_op"].values()) for d in runs])
    header = ["N", "stage", "collectives", "elements", f"{uname} moved", "min chunk", "max chunk", "blocks"]
    if ct:
        header += ["time", "latency"]
    body = []
    for d in runs:
        s = d["summary"]
        el = sum(v["counted_elements"] for v in s["by_op"].values())
        by = sum(v["bytes"] for v in s["by_op"].values())
        row = [d["N"], d["stage"], count(s["collectives"]), count(el), gib(by, unit),
               count(s["smallest_chunk_elements"]), count(s["largest_chunk_elements"]), count(d["blocks"])]
        if ct:
            row += [secs(d["comm_time"]["seconds"]), f"{d['comm_time']['latency_fraction']:.0%}"]
        body.append(row)
    lines.append(table(header, body))
    lines.append("min/max chunk: elements per rank in one bucket collective (block / N).")
    return "\n".join(lines)


def render_nodes(nodes: dict) -> str:
    """Each run's own mode (*) and every other across nodes (hierarchy.py)."""
    results, inter, intra = nodes["modes"], nodes["inter"], nodes["intra"]
    uname, unit = pick_unit([d["per_rank_bytes"] for d in results])
    head = ["N", "P", "stage", "mode", "K x G", "states", "secondary", "buffers", f"total {uname}",
            "in node/rank", "across/rank", "per node link", "time", "inter"]
    body = []
    for d in results:
        body.append([d["N"], d["ranks_per_node"], d["stage"], f"{'* ' if d['own'] else ''}{d['name']} ({d['mode']})",
                     f"{d['shard_group']} x {d['replicas']}", gib(d["model_states"], unit),
                     gib(d["secondary_bytes"], unit) if d["secondary_group"] else "-", gib(d["buffers"], unit),
                     gib(d["per_rank_bytes"], unit), _bytes(d["intra_bytes_per_rank"]),
                     _bytes(d["cross_bytes_per_rank"]), _bytes(d["node_link_bytes"]),
                     secs(d["time"]["seconds"]),
                     f"{d['time']['inter_seconds'] / max(d['time']['seconds'], 1e-30):.0%}"])
    own, q, tp = nodes["own"], nodes["nics_per_node"], nodes.get("tp", 1)
    tp_line = ([f"tp {tp}: P is one data-parallel group's ranks on a node ({tp} x P ranks in all, whole tp groups); "
                f"the node's {tp} groups move the same bytes at once, so each gets 1/{tp} of its links; "
                "the tp groups' own collectives (inside a node) are not priced."] if tp > 1 else [])
    return "\n".join([
        f"Across nodes (hierarchy.py), ranks in blocks of P per node; links: between nodes {inter['name']} "
        f"({inter['alpha'] * 1e6:g} us, {_gbs(inter['beta'])} GB/s, "
        + (f"{q} per node" if q else "one per rank") + f"), inside {intra['name']} "
        f"({intra['alpha'] * 1e6:g} us, {_gbs(intra['beta'])} GB/s).",
        *tp_line,
        table(head, body),
        f"*: this run's mode (shard_group {own['shard_group']}, comm.hierarchical {own['hierarchical']}, "
        f"stage3.secondary_partition {own['secondary']}); the others: zero.* set as named "
        "(docs/scaling.md, \"Hierarchy\").",
        "K x G: ranks per shard group x replica groups. states: model states per rank (exact, the engine's "
        "layout at K); secondary: stage-3 node-local copies;",
        "buffers: the reducer's (exact). Bytes per step each rank sends inside its node and across nodes, and "
        "what crosses each node's link each way (the job's bytes across / nodes);",
        "time: alpha-beta, sub-collectives in sequence, no overlap; inter: its share spent on the link between "
        "nodes."])


def _bytes(b: float) -> str:
    return f"{b / 2**30:.3g} GiB" if b >= 2**30 else f"{b / 2**20:.3g} MiB"


def _gbs(beta: float) -> str:
    return f"{1 / beta / 1e9:.3g}" if beta else "inf"


OP_SHORT = {"reduce_scatter": "RS", "all_gather": "AG", "all_reduce": "AR"}


def kib(b: int) -> str:
    return f"{b / 1024:,.1f} KiB" if b < 2**20 else f"{b / 2**20:,.2f} MiB"


def render_buckets(runs: list[dict]) -> str:
    """The resolved bucket, the reducer's buffers it costs, and the smallest per-rank
    chunk of each collective in that collective's own bytes."""
    header = ["N", "stage", "bucket (elements)", "largest block", "buffers / rank", "smallest chunk per op"]
    uname, unit = pick_unit([d["buffers"] for d in runs])
    body = []
    for d in runs:
        mins = [f"{OP_SHORT.get(op, op)} {kib(v['smallest_chunk_bytes'])}"
                for op, v in sorted(d["summary"]["by_op"].items()) if v["smallest_chunk_bytes"] is not None]
        body.append([d["N"], d["stage"], count(d["bucket"]) + (" (floor on blocks)" if d["at_least"] else ""),
                     count(d["block"]), f"{d['buffers']:,} B ({gib(d['buffers'], unit)} {uname})", ", ".join(mins)])
    return "\n".join([table(header, body),
                      "bucket: zero.bucket_size resolved at N (\"auto\": sized so the narrowest collective's "
                      "chunk reaches the latency target, zero.buckets.auto_bucket_elements);",
                      "buffers: the gradient reducer's (memory_report()['buffers']), bucket_count slots of "
                      "~2 largest blocks in the reduce dtype;",
                      "smallest chunk: bytes per rank in one collective, RS/AR in the reduce dtype, AG in "
                      "the param dtype."])


def render_collectives(d: dict) -> str:
    ct = d.get("comm_time")
    header = ["op", "elements each", "per rank", "bytes each", "count/step", "elements/step", "bytes/step"]
    if ct:
        header += ["time/step"]
    body = []
    for i, r in enumerate(d["collectives"]):
        row = [r["op"] + (" (scalars)" if r["scalars"] else ""), count(r["elements"]),
               count(r["chunk_elements"]), count(r["nbytes"]), count(r["count"]),
               count(r["counted_elements"]), count(r["bytes_per_step"])]
        if ct:
            row.append(secs(ct["rows"][i]["seconds"]))
        body.append(row)
    return f"Collectives of one step at N = {d['N']}, stage {d['stage']}:\n" + table(header, body)


def render_dry_run(res: dict) -> str:
    out = [res["model"], res["settings"],
           f"Meta model built in {res['meta_seconds']:.2f} s with no parameter storage (checked); whole dry "
           f"run {res['seconds']:.1f} s, peak RSS grew {res['rss_growth_mib']:.0f} MiB.", ""]
    header = ["N", "stage", "T (padded)", "padding", "per-rank states", "bytes", "= formula(T)",
              "vs formula(Ψ)", "real el. imbalance", "collectives", "chunk min / max", "blocks", "time"]
    body = []
    for d in res["runs"]:
        st = d["memory_report"][str(0)]["model_states"]
        diff = st - d["formula_at_psi"]["model_states"]
        bal = d["real_elements"]
        imb = "all ranks hold all" if d["stage"] == 0 else \
            f"{bal['imbalance']:,} ({bal['imbalance_fraction']:.2%})"
        s = d["summary"]
        body.append([d["N"], d["stage"], count(d["padded"]), count(d["padding"]), f"{gib(st)} GiB",
                     count(st), "yes" if d["equal_formula"] else "NO", f"+{diff:,.0f} B",
                     imb, count(s["collectives"]),
                     f"{count(s['smallest_chunk_elements'])} / {count(s['largest_chunk_elements'])}",
                     count(d["blocks"]), f"{d['seconds']:.2f} s"])
    out.append(table(header, body))
    out.append("per-rank states: memory_report()['model_states'] of a ShardState built as the engine builds "
               "it (meta placement)")
    out.append("for ranks 0 and N-1; = formula(T): every term equals the paper's formula at the padded T.")
    out.append("real el. imbalance: max - min over all N ranks of parameter elements owned (the rest is "
               "padding; memory is equal).")
    checked = sorted({(d["N"], k) for d in res["runs"] for k in d["real_elements"]["checked_ranks"]})
    by_n: dict[int, list[str]] = {}
    for n, r in checked:
        by_n.setdefault(n, []).append(r)
    out.append("Counts of every rank from the gap walk; recounted from layout.pieces for ranks "
               + "; ".join(f"N = {n}: {', '.join(sorted(rs, key=int))}" for n, rs in by_n.items()) + ".")
    out.append("chunk min / max: elements per rank in one bucket collective (block / N); blocks are balanced, "
               "so the smallest come from stage-3 units shorter than a bucket.")
    out.append("time: this row's part (a layout is built once per N and shared by stages 0-2).")
    out.append("")
    out.append(render_buckets(res["runs"]))
    if res.get("nodes"):
        out += ["", render_nodes(res["nodes"])]
    return "\n".join(out)
