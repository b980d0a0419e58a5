"""Plot a training run: `python -m zerompi.plot RUN_DIR [--out file.png]`.

Reads RUN_DIR/metrics.jsonl (written by zerompi.train) and draws three panels: train and
validation loss, throughput (tokens/s), and memory (peak RSS over ranks, and the
engine's model-state bytes per rank). Default output: RUN_DIR/metrics.png.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def read_metrics(path: Path) -> list[dict]:
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            pass  # a last line cut short by a kill
    return rows


def plot(run_dir: str | Path, out: str | Path | None = None) -> Path:
    try:
        import matplotlib
    except ImportError:  # a dependency of the package; only a hand-made install lacks it
        raise ValueError("matplotlib is not installed: pip install matplotlib "
                         "(or reinstall zerompi: bash install.sh)") from None

    matplotlib.use("Agg")  # no display on cluster nodes
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    path = run_dir / "metrics.jsonl" if run_dir.is_dir() else run_dir
    rows = read_metrics(path)
    if not rows:
        raise ValueError(f"{path}: no metrics")
    out = Path(out) if out else path.parent / "metrics.png"

    step = [r["step"] for r in rows]
    val = [(r["step"], r["val_loss"]) for r in rows if r.get("val_loss") is not None]
    fig, (ax_loss, ax_tput, ax_mem) = plt.subplots(3, 1, figsize=(8, 9), sharex=True)

    ax_loss.plot(step, [r["loss"] for r in rows], lw=0.8, alpha=0.8, label="train")
    if val:
        ax_loss.plot(*zip(*val), "o-", ms=3, label="val")
    ax_loss.set_ylabel("loss")
    ax_loss.set_title(str(run_dir))
    ax_loss.legend()
    ax_loss.grid(alpha=0.3)

    # Steps that ran an evaluation or a checkpoint are slow outliers; the median of a
    # short window keeps the throughput line readable.
    tput = [r["tokens_per_s"] for r in rows]
    k = max(1, len(tput) // 100)
    smooth = [sorted(tput[max(0, i - k):i + k + 1])[len(tput[max(0, i - k):i + k + 1]) // 2]
              for i in range(len(tput))]
    ax_tput.plot(step, tput, lw=0.5, alpha=0.3, color="C2")
    ax_tput.plot(step, smooth, lw=1.2, color="C2")
    ax_tput.set_ylabel("tokens/s")
    ax_tput.grid(alpha=0.3)

    mb = 1 / 2**20
    ax_mem.plot(step, [r["rss"] * mb for r in rows], label="RSS (max over ranks)")
    ax_mem.plot(step, [r["model_state_bytes"] * mb for r in rows], label="model states per rank")
    ax_mem.set_yscale("log")  # model states are often far smaller than the process
    ax_mem.set_ylabel("MiB")
    ax_mem.set_xlabel("step")
    ax_mem.legend()
    ax_mem.grid(alpha=0.3)

    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m zerompi.plot", description=__doc__.split("\n")[0])
    ap.add_argument("run_dir", help="a run directory (or its metrics.jsonl)")
    ap.add_argument("--out", help="PNG to write (default: RUN_DIR/metrics.png)")
    args = ap.parse_args(argv)
    try:
        out = plot(args.run_dir, args.out)
    except (OSError, ValueError, KeyError) as e:
        print(f"zerompi.plot: error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
