"""Optimizers over a rank's shard: the segment table and the host AdamW (adamw.py).
A fused CuPy AdamW over the same table (adamw_fused.py) and host offload come with the
GPU data path (issue 11).

    param_groups = zerompi.optim.decay_groups(model, 0.1)   # the usual GPT split
"""
from .adamw import GROUP_KEYS, Segment, ShardedAdamW, build_groups, build_segments, decay_groups

__all__ = ["GROUP_KEYS", "Segment", "ShardedAdamW", "build_groups", "build_segments", "decay_groups"]
