"""Who talks to whom: the process grid (dims.py). Tensor parallelism and ZeRO-R
activation partitioning will live here too (issue 15)."""
from .dims import ParallelDims

__all__ = ["ParallelDims"]
