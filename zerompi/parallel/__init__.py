"""Who talks to whom: the process grid (dims.py); ZeRO-R activation checkpointing of the
model's blocks, Pa over the tp group (activations.py, ckpt_store.py). Tensor
parallelism will live here too (issue 15)."""
from .dims import ParallelDims

__all__ = ["ParallelDims"]
