#!/usr/bin/env python
"""Plot the merged JSON of bench_dp.py --driver: step time and peak RSS per rank.

    python benchmarks/plot_dp.py benchmarks/results/dp_cpu.json benchmarks/results/dp_cpu.png

Columns: models. Rows: median step time (whiskers: min-max of the timed steps; white
dot: CPU seconds per step, mean over ranks) and peak RSS per rank (bars: peak during the
training steps, the faded part is the runtime before the model; black dot: whole-process
peak including set-up; red dash: runtime + the ZeRO formula's model-state bytes; dotted
line across each N: stage 0's model states / N, 16*Psi/N, the stage-3 target).
Within a panel runs are grouped by N. Inside each N, systems are ordered by ZeRO stage
(0, 1, 2, then the shaded stage-3 group) and coloured by implementation: zerompi blues,
torch oranges, DeepSpeed greens, darker = higher stage. Hatched bars ran with
MALLOC_MMAP_THRESHOLD_=131072.
"""
from __future__ import annotations

import json
import sys

GiB = 1 << 30
# Order = position inside an N group (by stage); colour family = implementation.
COLORS = {
    "zerompi-0": "#c6dbef", "ddp": "#fdd0a2",
    "zerompi-1": "#6baed6", "torch-zero": "#fd8d3c", "deepspeed-1": "#a1d99b",
    "zerompi-2": "#2171b5", "deepspeed-2": "#41ab5d",
    "zerompi-3": "#08306b", "fsdp2": "#a63603", "deepspeed-3": "#00441b",
    "zerompi-0-bf16": "#dadaeb", "zerompi-1-bf16": "#9e9ac8", "zerompi-2-bf16": "#6a51a3",
    "zerompi-3-bf16": "#3f007d",
}
STAGE = {"zerompi-0": 0, "ddp": 0, "zerompi-1": 1, "torch-zero": 1, "deepspeed-1": 1,
         "zerompi-2": 2, "deepspeed-2": 2, "zerompi-3": 3, "fsdp2": 3, "deepspeed-3": 3,
         "zerompi-0-bf16": 0, "zerompi-1-bf16": 1, "zerompi-2-bf16": 2, "zerompi-3-bf16": 3}
HATCH = {"default": "", "mmap128k": "//"}
GAP = 0.6  # extra space between stage groups, in bar widths


def _sys_order(systems):
    known = list(COLORS)
    return sorted(systems, key=lambda s: (STAGE.get(s, 9), known.index(s) if s in known else len(known)))


def _slots(series):
    """x offset (in bar widths, centred on 0) of each series, with a gap between stages."""
    pos, x, prev = [], 0.0, None
    for s, _ in series:
        st = STAGE.get(s, 9)
        if prev is not None and st != prev:
            x += GAP
        pos.append(x)
        x += 1.0
        prev = st
    mid = (pos[-1] if pos else 0.0) / 2
    return [p - mid for p in pos], (pos[-1] + 1.0 if pos else 1.0)


def plot(doc: dict, png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    runs = doc["runs"]
    models = [m for m in doc["parameters"]["models"] if any(r["model"] == m for r in runs)] \
        or sorted({r["model"] for r in runs})
    systems = _sys_order({r["system"] for r in runs})
    mallocs = [m for m in doc["parameters"].get("malloc", ["default"]) if any(r["malloc"] == m for r in runs)]
    series = [(s, mal) for s in systems for mal in mallocs]
    offs, span = _slots(series)
    width = 0.84 / max(1.0, span)
    ncol = max(1, len(models))
    fig, axes = plt.subplots(2, ncol, figsize=(max(8.0, 8.0 * ncol), 9.0), squeeze=False)
    for c, model in enumerate(models):
        mruns = [r for r in runs if r["model"] == model]
        ns = sorted({r["n"] for r in mruns})
        ax_t, ax_m = axes[0][c], axes[1][c]
        for k, n in enumerate(ns):
            s3 = [k + offs[j] * width for j, (s, _) in enumerate(series) if STAGE.get(s) == 3]
            if s3:  # shade the stage-3 comparison
                for ax in (ax_t, ax_m):
                    ax.axvspan(min(s3) - 0.6 * width, max(s3) + 0.6 * width, color="#eeeeee", zorder=0)
            nr = [r for r in mruns if r["n"] == n]
            if nr:  # the stage-3 target: stage 0's model states split N ways
                lo, hi = k + offs[0] * width - width / 2, k + offs[-1] * width + width / 2
                ax_m.hlines(16 * nr[0]["params"] / n / GiB, lo, hi, color="black",
                            linestyles=":", linewidth=1.2, zorder=4)
        for j, (s, mal) in enumerate(series):
            for k, n in enumerate(ns):
                hit = [r for r in mruns if r["system"] == s and r["malloc"] == mal and r["n"] == n]
                if not hit:
                    continue
                r = hit[0]
                x = k + offs[j] * width
                style = dict(color=COLORS.get(s, "grey"), hatch=HATCH.get(mal, ".."),
                             edgecolor="black", linewidth=0.4, zorder=2)
                med = r["step_time_s_median"]
                ax_t.bar(x, med, width, **style)
                ax_t.errorbar(x, med, yerr=[[med - r["step_time_s_min"]], [r["step_time_s_max"] - med]],
                              color="black", linewidth=0.7, capsize=1.5, zorder=3)
                cpu = r.get("step_cpu_s_median_mean_rank")
                if cpu is not None:
                    ax_t.plot(x, cpu, "o", mfc="white", mec="black", ms=3.5, mew=0.7, zorder=4)
                peak_steps = r.get("peak_rss_steps_bytes_max_rank") or r["peak_rss_process_bytes_max_rank"]
                base = max(rk.get("rss_runtime", 0) for rk in r["ranks"])
                ax_m.bar(x, peak_steps / GiB, width, **style)
                ax_m.bar(x, min(base, peak_steps) / GiB, width, color="white", alpha=0.45,
                         linewidth=0, zorder=2.5)
                ax_m.plot(x, r["peak_rss_process_bytes_max_rank"] / GiB, "o", color="black", ms=3, zorder=4)
                ax_m.hlines((base + r["expected_model_states_bytes_per_rank"]) / GiB,
                            x - width / 2, x + width / 2, color="red", linewidth=1.5, zorder=4)
        psi = mruns[0]["params"] if mruns else 0
        shape = f"{mruns[0]['micro_batch']}x{mruns[0]['seq_len']} tokens/rank" if mruns else ""
        over = [n for n in ns if any(r["n"] == n and r.get("oversubscribed") for r in mruns)]
        labels = [f"N={n}" + (" (oversub.)" if n in over else "") for n in ns]
        for ax in (ax_t, ax_m):
            ax.set_xticks(range(len(ns)))
            ax.set_xticklabels(labels)
            ax.grid(axis="y", alpha=0.3)
            ax.set_axisbelow(True)
        ax_t.set_title(f"{model} ({psi / 1e6:.1f}M params, {shape}); shaded: stage 3")
        ax_t.set_ylabel("median step time [s] (max over ranks)")
        ax_m.set_ylabel("peak RSS per rank [GiB] (max over ranks)")
    # systems legend: one column per ZeRO stage, headed by the stage
    blank = Patch(facecolor="none", edgecolor="none", label="")
    stages = sorted({STAGE.get(s, 9) for s in systems})
    cols = [[s for s in systems if STAGE.get(s, 9) == st] for st in stages]
    rows = max(len(c) for c in cols) + 1
    sys_handles = []
    for st, col in zip(stages, cols):
        head = Patch(facecolor="none", edgecolor="none", label=f"stage {st}" if st != 9 else "other")
        sys_handles += [head] + [Patch(facecolor=COLORS.get(s, "grey"), edgecolor="black", label=s)
                                 for s in col] + [blank] * (rows - 1 - len(col))
    marks = [Patch(facecolor="white", edgecolor="black", hatch=HATCH.get(m, ".."),
                   label=f"malloc: {m}") for m in mallocs if len(mallocs) > 1]
    marks += [
        plt.Line2D([], [], color="black", marker="o", mfc="white", ls="", ms=3.5,
                   label="CPU s/step (median, mean over ranks)"),
        plt.Line2D([], [], color="black", marker="o", ls="", ms=3, label="whole-process peak RSS"),
        plt.Line2D([], [], color="red", lw=1.5, label="runtime + formula model states"),
        plt.Line2D([], [], color="black", lw=1.2, ls=":", label="stage-0 model states / N (16Ψ/N)"),
        Patch(facecolor="#bbbbbb", edgecolor="none", label="faded: RSS before the model"),
    ]
    fig.legend(handles=sys_handles, loc="lower left", ncol=len(stages), fontsize=8,
               bbox_to_anchor=(0.01, 0.0), frameon=False)
    fig.legend(handles=marks, loc="lower right", ncol=2, fontsize=8, bbox_to_anchor=(0.99, 0.0),
               frameon=False)
    mach = doc.get("machine", {})
    over_n = doc.get("oversubscribed_n") or []
    title = (f"Data parallel on CPU, AdamW, fp32 unless '-bf16': zerompi (MPI) vs torch DDP / "
             f"ZeroRedundancyOptimizer / FSDP2 and DeepSpeed ZeRO (gloo)\n"
             f"machine: {mach.get('node', '?')}, {mach.get('cpu_model', '?')}, {mach.get('cores', '?')} cores, "
             f"{(mach.get('ram_bytes') or 0) / GiB:.0f} GiB RAM; "
             f"{doc['parameters'].get('threads_per_rank', 1)} thread/rank"
             + (f"; N={','.join(map(str, over_n))} oversubscribes the cores" if over_n else ""))
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.02 + 0.021 * max(rows, -(-len(marks) // 2)), 1, 0.95))
    fig.savefig(png, dpi=130)
    plt.close(fig)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        sys.exit("usage: plot_dp.py RESULTS.json OUT.png")
    with open(argv[0]) as f:
        plot(json.load(f), argv[1])


if __name__ == "__main__":
    main()
