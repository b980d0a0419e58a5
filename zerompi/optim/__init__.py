"""Optimizers over a rank's shard: the segment table and the host AdamW (adamw.py), and
the same update as one table-driven CUDA launch per shard (fused_adamw.py;
its logic runs on the CPU through the kernels' numpy references), and torch's fused CPU
AdamW over the host shard for the offloaded optimizer (host_fused.py).

    param_groups = zerompi.optim.decay_groups(model, 0.1)   # the usual GPT split
"""
from .adamw import GROUP_KEYS, Segment, ShardedAdamW, build_groups, build_segments, decay_groups
from .fused_adamw import FusedShardAdamW
from .host_fused import HostFusedAdamW

__all__ = ["GROUP_KEYS", "FusedShardAdamW", "HostFusedAdamW", "Segment", "ShardedAdamW", "build_groups",
           "build_segments", "decay_groups"]
