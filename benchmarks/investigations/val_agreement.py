"""Validation loss of the tiny GPT after a fixed token budget, across stages 0-3 and
N = 1, 2, 4 (issue 6): every run is `python -m zerompi.train` with configs/tiny.toml.

    python benchmarks/investigations/val_agreement.py --steps 200 \
        --out benchmarks/investigations/results/val_agreement.json \
        --png benchmarks/investigations/results/val_agreement.png

All runs see the same global batches (the sampler is a function of (seed, step) only)
and the update equals AdamW on the global batch at every N and stage, so their losses
can differ only by floating-point summation order. The stated tolerance: every final
validation loss within 1e-3 of the N=1 stage-0 run (fp32).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: one folder up
from bench_env import ROOT  # noqa: E402
from launch import launch  # noqa: E402

TOL = 1e-3


def run(stage: int, n: int, steps: int, work: Path, timeout: float) -> dict:
    rd = work / f"s{stage}-n{n}"
    job = launch(n, ["-m", "zerompi.train", "--config", ROOT / "configs/tiny.toml",
                     "--zero.stage", stage, "--max_steps", steps, "--eval_interval", steps,
                     "--checkpoint_interval", 10 * steps, "--resume", "false", "--run_dir", rd,
                     "--progress", "none", "--lr_decay_steps", steps], timeout=timeout)
    if not job.ok:
        sys.exit(f"stage {stage} N={n} failed ({job.status}): {job.command_line}\n{job.tail()}")
    rows = [json.loads(l) for l in (rd / "metrics.jsonl").read_text().splitlines() if l.strip()]
    val = [r["val_loss"] for r in rows if r.get("val_loss") is not None]
    return {"stage": stage, "world": n, "val_loss": val[-1], "train_loss": [r["loss"] for r in rows
            if "loss" in r], "wall_s": job.elapsed_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--out", default="benchmarks/investigations/results/val_agreement.json")
    ap.add_argument("--png", default="benchmarks/investigations/results/val_agreement.png")
    ap.add_argument("--work", default="/tmp/zerompi_val_agreement")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per training job")
    ap.add_argument("--stages", nargs="+", type=int, default=[0, 1, 2, 3])
    ap.add_argument("--nranks", nargs="+", type=int, default=[1, 2, 4])
    a = ap.parse_args()
    work = Path(a.work)
    runs = [run(s, n, a.steps, work, a.timeout) for n in a.nranks for s in a.stages]
    base = runs[0]["val_loss"]  # the first stage at the first N (stage 0, N = 1 by default)
    spread = max(abs(r["val_loss"] - base) for r in runs)
    res = {"machine": {"node": platform.node(), "cpu": platform.processor() or platform.machine(),
                       "cores": os.cpu_count()},
           "date": time.strftime("%Y-%m-%d"), "config": "configs/tiny.toml", "steps": a.steps,
           "tokens": a.steps * 32 * 64, "tolerance": TOL, "max_abs_dev_from_n1_stage0": spread,
           "agree": spread <= TOL, "runs": runs}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for r in runs:
        ax1.plot(r["train_loss"], lw=0.8, label=f"stage {r['stage']}, N={r['world']}")
    ax1.set(xlabel="step", ylabel="train loss", title=f"train loss, {len(runs)} runs (overlapping)")
    ax1.legend(fontsize=6, ncol=2)
    labels = [f"s{r['stage']}\nN={r['world']}" for r in runs]
    # |deviation| on a log axis (the reference run itself is drawn at the 1e-9 floor)
    ax2.bar(range(len(runs)), [max(abs(r["val_loss"] - base), 1e-9) for r in runs])
    ax2.axhline(TOL, color="r", ls="--", lw=0.8, label=f"tolerance {TOL}")
    ax2.set_yscale("log")
    ax2.set_ylim(1e-9, 1e-1)
    ax2.set_xticks(range(len(runs)), labels, fontsize=7)
    ax2.legend(fontsize=7)
    ax2.set(ylabel="|val loss - val loss(stage 0, N=1)|", title=f"final val loss {base:.4f}")
    fig.suptitle(f"tiny GPT, {res['tokens']} tokens, fp32 — {res['machine']['node']} "
                 f"({res['machine']['cpu']}, {res['machine']['cores']} cores)", fontsize=9)
    fig.tight_layout()
    fig.savefig(a.png, dpi=110)
    print(json.dumps({k: res[k] for k in ("max_abs_dev_from_n1_stage0", "agree")}))


if __name__ == "__main__":
    main()
