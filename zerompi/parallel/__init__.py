"""Who talks to whom: the process grid (dims.py); tensor parallelism (tensor_parallel.py:
the layers; parallelize.py: applied to the reference GPT; tp_layout.py: where tp pieces
sit in the full tensor); ZeRO-R activation checkpointing of the model's blocks, Pa over
the tp group (activations.py, ckpt_store.py)."""
from .dims import ParallelDims

__all__ = ["ParallelDims"]
