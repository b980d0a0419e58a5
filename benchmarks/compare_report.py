"""compare_commits.py's results: per-configuration statistics, the summary over all
configurations, the printed table and the plot (ratios after/before, machine named)."""
from __future__ import annotations

import math
import statistics

GiB = 1 << 30


def _median(xs):
    return statistics.median(xs) if xs else None


def _ratio(a, b):
    return a / b if (a is not None and b) else None


def _loss_diff(a: list, b: list) -> float | None:
    if not a or not b or len(a) != len(b):
        return None
    return max(abs(x - y) for x, y in zip(a, b))


def _volume(comm_stats: dict | None) -> dict | None:
    if not isinstance(comm_stats, dict):
        return None
    return {k: {kk: vv for kk, vv in v.items() if kk != "seconds"} if isinstance(v, dict) else v
            for k, v in comm_stats.items()}


def summarize(cfg: dict, runs: list[dict], warmup: int) -> dict:
    """Per-configuration statistics from its finished runs (worker JSON + driver fields)."""
    out = {k: cfg[k] for k in ("model", "n", "stage", "system")}
    per = {}
    for side in ("before", "after"):
        rs = [r for r in runs if r["side"] == side]
        steps = [t for r in rs for t in r["step_time_s_per_step"][warmup:]]
        # CPU seconds per timed step, mean over ranks
        cpu = [statistics.mean(rk["step_cpu_s"][i] for rk in r["ranks"])
               for r in rs for i in range(warmup, len(r["step_time_s_per_step"]))]
        peak_steps = [r.get("peak_rss_steps_bytes_max_rank") for r in rs]
        peak_proc = [r["peak_rss_process_bytes_max_rank"] for r in rs]
        per[side] = {
            "runs": len(rs),
            "step_time_s_median": _median(steps),
            "step_time_s_per_repeat_median": [r["step_time_s_median"] for r in rs],
            "step_time_s_samples": steps,
            "step_cpu_s_median": _median(cpu),
            "step_cpu_s_samples": cpu,
            "peak_rss_steps_bytes_max_rank_median": _median([p for p in peak_steps if p]),
            "peak_rss_steps_bytes_per_rank": [[rk.get("peak_rss_steps") for rk in r["ranks"]]
                                              for r in rs],
            "peak_rss_process_bytes_max_rank_median": _median(peak_proc),
            "peak_rss_process_bytes_per_rank": [[rk["peak_rss_process"] for rk in r["ranks"]]
                                                for r in rs],
            "setup_s_max_rank": [max(rk["setup_s"] for rk in r["ranks"]) for r in rs],
            "wall_s": [r["wall_s"] for r in rs],
            "loadavg_start": [r.get("loadavg_start") for r in rs],
        }
        if rs:
            out["params"] = rs[0]["params"]
            out["micro_batch"], out["seq_len"] = rs[0]["micro_batch"], rs[0]["seq_len"]
            out["oversubscribed"] = rs[0].get("oversubscribed")
    out.update(per)
    b, a = per["before"], per["after"]
    out["ratio_step_time"] = _ratio(a["step_time_s_median"], b["step_time_s_median"])
    out["ratio_step_cpu"] = _ratio(a["step_cpu_s_median"], b["step_cpu_s_median"])
    out["ratio_peak_rss_steps"] = _ratio(a["peak_rss_steps_bytes_max_rank_median"],
                                         b["peak_rss_steps_bytes_max_rank_median"])
    out["ratio_peak_rss_process"] = _ratio(a["peak_rss_process_bytes_max_rank_median"],
                                           b["peak_rss_process_bytes_max_rank_median"])
    # every (after repeat, before repeat) pair of per-run medians: the spread of the ratio
    pairs = [x / y for x in a["step_time_s_per_repeat_median"]
             for y in b["step_time_s_per_repeat_median"] if y]
    out["ratio_step_time_pairs"] = pairs
    # how much one side differs from itself between repeats (max/min of its run medians):
    # a ratio inside this spread is indistinguishable from noise
    out["repeat_spread"] = {s: (max(v) / min(v) if len(v) > 1 and min(v) > 0 else None)
                            for s, v in ((s, per[s]["step_time_s_per_repeat_median"])
                                         for s in ("before", "after"))}
    # same computation on both sides? (fp32, same seed, same batches)
    rb = [r for r in runs if r["side"] == "before"]
    ra = [r for r in runs if r["side"] == "after"]
    if rb and ra:
        out["loss_max_abs_diff_after_vs_before"] = _loss_diff(ra[0]["loss_per_step"],
                                                              rb[0]["loss_per_step"])
        out["loss_max_abs_diff_between_repeats"] = max(
            [d for rs in (rb, ra) for r in rs[1:]
             if (d := _loss_diff(r["loss_per_step"], rs[0]["loss_per_step"])) is not None],
            default=None)
        out["params_equal"] = rb[0]["params"] == ra[0]["params"]
        mb = [rk.get("memory_report") for rk in rb[0]["ranks"]]
        ma = [rk.get("memory_report") for rk in ra[0]["ranks"]]
        out["memory_report_equal"] = mb == ma
        out["comm_volume_equal"] = ([_volume(rk.get("comm_stats")) for rk in rb[0]["ranks"]]
                                    == [_volume(rk.get("comm_stats")) for rk in ra[0]["ranks"]])
        if not out["memory_report_equal"]:
            out["memory_report"] = {"before": mb, "after": ma}
    return out


def overall(configs: list[dict]) -> dict:
    rs = [c["ratio_step_time"] for c in configs if c.get("ratio_step_time")]
    rc = [c["ratio_step_cpu"] for c in configs if c.get("ratio_step_cpu")]
    rm = [c["ratio_peak_rss_steps"] for c in configs if c.get("ratio_peak_rss_steps")]
    gm = lambda v: math.exp(statistics.mean(math.log(x) for x in v)) if v else None  # noqa: E731
    worst = max((c for c in configs if c.get("ratio_step_time")),
                key=lambda c: c["ratio_step_time"], default=None)
    return {
        "configs": len(configs),
        "geomean_ratio_step_time": gm(rs), "geomean_ratio_step_cpu": gm(rc),
        "geomean_ratio_peak_rss_steps": gm(rm),
        "max_ratio_step_time": worst and worst["ratio_step_time"],
        "max_ratio_step_time_config": worst and f"{worst['model']} N={worst['n']} stage {worst['stage']}",
        "max_ratio_peak_rss_steps": max(rm, default=None),
        "all_params_equal": all(c.get("params_equal") for c in configs),
        "all_losses_equal": all(c.get("loss_max_abs_diff_after_vs_before") == 0.0 for c in configs),
        "all_memory_reports_equal": all(c.get("memory_report_equal") for c in configs),
        "all_comm_volumes_equal": all(c.get("comm_volume_equal") for c in configs),
    }


def print_table(doc: dict) -> None:
    f = lambda v, d=3: "-" if v is None else f"{v:.{d}f}"  # noqa: E731
    print(f"{'model':9s} {'N':>2s} {'st':>2s} | {'before s':>8s} {'after s':>8s} {'ratio':>6s} "
          f"{'pairs':>13s} {'cpu r':>6s} | {'RSS b GiB':>9s} {'RSS a GiB':>9s} {'ratio':>6s} | "
          f"{'loss=':>5s} {'mem=':>4s} {'comm=':>5s}")
    for c in doc["configs"]:
        b, a = c["before"], c["after"]
        pr = c["ratio_step_time_pairs"]
        rng = f"{min(pr):.3f}-{max(pr):.3f}" if pr else "-"
        rb, ra = b["peak_rss_steps_bytes_max_rank_median"], a["peak_rss_steps_bytes_max_rank_median"]
        d = c.get("loss_max_abs_diff_after_vs_before")
        loss_eq = None if d is None else d == 0.0
        print(f"{c['model']:9s} {c['n']:2d} {c['stage']:2d} | {f(b['step_time_s_median']):>8s} "
              f"{f(a['step_time_s_median']):>8s} {f(c['ratio_step_time']):>6s} {rng:>13s} "
              f"{f(c['ratio_step_cpu']):>6s} | {f(rb and rb / GiB, 2):>9s} {f(ra and ra / GiB, 2):>9s} "
              f"{f(c['ratio_peak_rss_steps']):>6s} | "
              f"{str(loss_eq):>5s} "
              f"{str(c.get('memory_report_equal')):>4s} {str(c.get('comm_volume_equal')):>5s}")
    s = doc.get("summary", {})
    if s.get("geomean_ratio_step_time"):
        print(f"geomean after/before: step time {s['geomean_ratio_step_time']:.3f}, CPU s/step "
              f"{s['geomean_ratio_step_cpu']:.3f}, peak RSS {s['geomean_ratio_peak_rss_steps']:.3f}; "
              f"worst step-time ratio {s['max_ratio_step_time']:.3f} ({s['max_ratio_step_time_config']})")


def plot(doc: dict, png: str) -> None:
    from harness import pyplot

    plt = pyplot()

    cs = [c for c in doc["configs"] if c.get("ratio_step_time")]
    if not cs:
        print("[compare] nothing to plot", flush=True)
        return
    labels = [f"{c['model']}\nN={c['n']} s{c['stage']}" for c in cs]
    x = list(range(len(cs)))
    fig, (ax_t, ax_m) = plt.subplots(2, 1, figsize=(max(9.0, 0.9 * len(cs) + 3), 8.5), sharex=True)
    stage_col = {1: "#6baed6", 2: "#2171b5", 3: "#08306b"}
    for xi, c in zip(x, cs):
        col = stage_col.get(c["stage"], "grey")
        r, pr = c["ratio_step_time"], c["ratio_step_time_pairs"] or [c["ratio_step_time"]]
        ax_t.errorbar(xi, r, yerr=[[max(0.0, r - min(pr))], [max(0.0, max(pr) - r)]], fmt="o",
                      color=col, ms=7, capsize=4, zorder=3)
        if c.get("ratio_step_cpu"):
            ax_t.plot(xi + 0.22, c["ratio_step_cpu"], "D", mfc="white", mec=col, ms=5, zorder=3)
        ax_t.annotate(f"{c['before']['step_time_s_median']:.3g}\u2192{c['after']['step_time_s_median']:.3g}s",
                      (xi, r), textcoords="offset points", xytext=(0, 9), ha="center", fontsize=7)
        if c.get("ratio_peak_rss_steps"):
            ax_m.plot(xi, c["ratio_peak_rss_steps"], "o", color=col, ms=7, zorder=3)
            b = c["before"]["peak_rss_steps_bytes_max_rank_median"] / GiB
            a = c["after"]["peak_rss_steps_bytes_max_rank_median"] / GiB
            ax_m.annotate(f"{b:.2f}\u2192{a:.2f}", (xi, c["ratio_peak_rss_steps"]),
                          textcoords="offset points", xytext=(0, 9), ha="center", fontsize=7)
        if c.get("ratio_peak_rss_process"):
            ax_m.plot(xi + 0.22, c["ratio_peak_rss_process"], "s", mfc="white", mec=col, ms=5, zorder=3)
    # group separators between models
    for xi in range(1, len(cs)):
        if cs[xi]["model"] != cs[xi - 1]["model"]:
            for ax in (ax_t, ax_m):
                ax.axvline(xi - 0.5, color="black", lw=0.6, alpha=0.5)
    for ax in (ax_t, ax_m):
        ax.axhline(1.0, color="black", lw=1.0)
        ax.grid(axis="y", alpha=0.3)
        ax.set_axisbelow(True)
        lo, hi = ax.get_ylim()
        ax.set_ylim(min(lo, 0.9), max(hi, 1.1))
    ax_t.set_ylabel("AFTER / BEFORE, median step time\n(whiskers: all repeat pairs)")
    ax_m.set_ylabel("AFTER / BEFORE, peak RSS per rank\n(max over ranks, during steps)")
    ax_m.set_xlim(-0.5, len(cs) - 0.5)
    ax_m.set_xticks(x)
    ax_m.set_xticklabels(labels, fontsize=8)
    handles = [plt.Line2D([], [], color=stage_col[s], marker="o", ls="", label=f"stage {s}")
               for s in sorted({c["stage"] for c in cs}) if s in stage_col]
    handles += [plt.Line2D([], [], color="black", marker="D", mfc="white", ls="", ms=5,
                           label="CPU s/step ratio"),
                plt.Line2D([], [], color="black", marker="s", mfc="white", ls="", ms=5,
                           label="whole-process peak RSS ratio")]
    fig.legend(handles=handles, fontsize=8, loc="lower center", ncol=len(handles), frameon=False)
    m, sd, p = doc.get("machine", {}), doc.get("sides", {}), doc.get("parameters", {})
    com = lambda s: ((sd.get(s, {}).get("git_commit") or "?")[:8]  # noqa: E731
                     + ("+dirty" if sd.get(s, {}).get("git_dirty_files") else ""))
    la0, la1 = doc.get("loadavg_at_start", [0])[0], doc.get("loadavg_at_end", [0])[0]
    sm = doc.get("summary", {})
    fig.suptitle(
        f"zerompi AFTER ({com('after')}) / BEFORE ({com('before')}): fp32 AdamW on CPU, "
        f"1 thread/rank, {p.get('repeats')} repeats per side in alternating order\n"
        f"machine: {m.get('node', '?')}, {m.get('cpu_model', '?')}, {m.get('cores', '?')} cores, "
        f"{(m.get('ram_bytes') or 0) / GiB:.0f} GiB RAM; 1-min load average {la0:.1f} at start, "
        f"{la1:.1f} at end"
        + (f"\ngeomean step-time ratio {sm['geomean_ratio_step_time']:.3f}, worst "
           f"{sm['max_ratio_step_time']:.3f} ({sm['max_ratio_step_time_config']})"
           if sm.get("geomean_ratio_step_time") else ""), fontsize=9)
    fig.tight_layout(rect=(0, 0.03, 1, 0.95))
    fig.savefig(png, dpi=130)
    plt.close(fig)
