"""Who talks to whom: the process grid (dims.py); which ranks share a node (nodes.py, no
torch: `python -m zerompi.train` checks the layout before it imports torch); tensor
parallelism (tensor_parallel.py: the layers; parallelize.py: applied to the reference
GPT; tp_layout.py: where tp pieces sit in the full tensor); ZeRO-R activation
checkpointing of the model's blocks, Pa over the tp group (activations.py, ckpt_store.py)."""
from __future__ import annotations

__all__ = ["ParallelDims"]


def __getattr__(name: str):
    # Lazy, so that importing parallel.nodes does not import torch (dims.py does).
    if name == "ParallelDims":
        from .dims import ParallelDims

        return ParallelDims
    raise AttributeError(f"module 'zerompi.parallel' has no attribute {name!r}")
