#!/usr/bin/env python
"""Plot of bench_async_checkpoint.py's report: per N x stage, each asynchronous writer's
stall per save over the synchronous save's time (the 10% line), the step time during a
background write over a normal step (the 1.15x line), and the training time each kind of
save cost (stall + what the steps in flight took beyond usual) next to the synchronous one.

    python benchmarks/plot_async_checkpoint.py benchmarks/results/checkpoint_async_cpu.json \
        benchmarks/results/checkpoint_async_cpu.png
"""
from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {"sync": "#888888", "thread": "#1f77b4", "process": "#d62728"}


def plot(report: dict, png: str) -> None:
    rows = report["summary"]
    labels = [f"N={s['n']}\nstage {s['stage']}" for s in rows]
    kinds = [k for k in ("thread", "process") if all(k in s for s in rows)]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    width = 0.8 / max(1, len(kinds))
    for ax, key, line, title in ((axes[0], "stall_over_sync", 0.10, "stall per save / sync save time (median)"),
                                 (axes[1], "step_ratio_median", 1.15, "step time during a background write\n"
                                                                       "/ normal step (median over saves)")):
        for j, k in enumerate(kinds):
            xs = [i + (j - (len(kinds) - 1) / 2) * width for i in range(len(rows))]
            ax.bar(xs, [s[k][key] for s in rows], width, label=k, color=COLORS[k])
        ax.axhline(line, color="k", ls="--", lw=1, label=f"target {line:g}")
        ax.set_xticks(range(len(rows)), labels)
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)
    ax = axes[2]
    all_kinds = ["sync"] + kinds
    width = 0.8 / len(all_kinds)
    for j, k in enumerate(all_kinds):
        xs = [i + (j - (len(all_kinds) - 1) / 2) * width for i in range(len(rows))]
        ax.bar(xs, [s[k]["lost_s_median"] for s in rows], width, label=k, color=COLORS[k])
    ax.set_xticks(range(len(rows)), labels)
    ax.set_ylabel("s")
    ax.set_title("training time lost per save (median)", fontsize=10)
    ax.legend(fontsize=8)
    m = report["machine"]
    fig.suptitle(f"{report['model']}, {report['tokens_per_rank_step']} tokens/rank/step; machine "
                 f"{m['name']} ({m['cores']} cores, {m['cpu']}), {report['date']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        plot(json.load(f), sys.argv[2])
