"""The PNG of bench_hierarchy.py: bytes across the inter-node link per step, measured
against predicted, and stage-3 step times per mode at the shaped link."""
from __future__ import annotations

import statistics


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = res["runs"]
    seen, rows = set(), []
    for r in runs:  # one bar pair per (stage, mode, link): the first repeat
        key = (r["stage"], r["name"], r["rate_mbit"])
        if key not in seen:
            seen.add(key)
            rows.append(r)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 5.2))
    x = range(len(rows))
    ax1.bar([i - 0.2 for i in x], [r["cross_bytes_per_step"] / 1e6 for r in rows], 0.4, label="measured (veth tx)")
    ax1.bar([i + 0.2 for i in x], [r["predicted_cross_bytes"] / 1e6 for r in rows], 0.4, label="estimator")
    for i, r in zip(x, rows):
        ax1.text(i, r["cross_bytes_per_step"] / 1e6, f"{r['ratio']:.3f}", ha="center", va="bottom", fontsize=7)
    ax1.set_xticks(list(x))
    ax1.set_xticklabels([f"s{r['stage']} {r['name']}" + ("" if r["rate_mbit"] else "\n(unshaped)") for r in rows],
                        rotation=60, ha="right", fontsize=8)
    ax1.set_ylabel("MB crossing the inter-node link per step (both nodes)")
    ax1.set_title("bytes across nodes: measured / predicted")
    ax1.legend(fontsize=8)
    rate = res["args"]["rate_mbit"]
    names = list(res["summary"]["step_seconds"])
    for i, m in enumerate(names):
        ts = [t for r in runs if r["stage"] == 3 and r["name"] == m and r["rate_mbit"] == rate
              for t in r["step_seconds"]]
        ax2.bar(i, statistics.median(ts), 0.6, color="C2" if m != "flat" else "C7")
        ax2.plot([i] * len(ts), ts, "k.", ms=4)
    flat = res["summary"]["step_seconds"]["flat"]
    for i, m in enumerate(names):
        ax2.text(i, res["summary"]["step_seconds"][m], f"{flat / res['summary']['step_seconds'][m]:.2f}x",
                 ha="center", va="bottom", fontsize=8)
    un = res["summary"].get("flat_unshaped_step_seconds")
    if un:
        ax2.axhline(un, ls="--", color="C3", lw=1, label=f"flat, unshaped link: {un:.2f} s")
        ax2.legend(fontsize=8)
    ax2.set_xticks(range(len(names)))
    ax2.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
    ax2.set_ylabel("seconds per step (slowest rank; median, dots: every step)")
    ax2.set_title(f"stage 3 at {rate:g} Mbit/s per node (speed-up over flat)")
    fig.suptitle(f"2 simulated nodes x 2 ranks on {res['machine']}; {res['cluster']['link']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
