"""TensorBoard and Weights & Biases beside metrics.jsonl (`tensorboard`, `wandb` keys).

Rank 0's Progress (progress.py) hands every step's metrics.jsonl record to `Sinks.log`,
which writes its numbers, under the same names, at the record's step: loss, lr,
grad_norm, tokens_per_s, val_loss at evaluations, ... (flags such as `updated` and the
`checkpoints` list stay in metrics.jsonl only). A resumed run redoes the steps after its
checkpoint: TensorBoard drops the earlier run's events from there on (purge_step), as
metrics.jsonl drops its lines; W&B starts a new run, whose steps continue the old one's.
"""
from __future__ import annotations

import os
from pathlib import Path


def scalars(record: dict) -> dict[str, float]:
    """The record's numbers, by their metrics.jsonl names (not the step)."""
    return {k: float(v) for k, v in record.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


class Sinks:
    def __init__(self, cfg, run_dir: Path, start_step: int, config: dict):
        self.tb = self.wandb = None
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(run_dir / "tensorboard"), flush_secs=10,
                                    purge_step=start_step + 1 if start_step else None)
        if cfg.wandb:
            import wandb

            self.wandb = wandb.init(project=os.environ.get("WANDB_PROJECT") or "zerompi",
                                    name=Path(run_dir).resolve().name, dir=str(run_dir), config=config)

    def log(self, record: dict) -> None:
        values, step = scalars(record), int(record["step"])
        if self.tb is not None:
            for k, v in values.items():
                self.tb.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log(values, step=step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
