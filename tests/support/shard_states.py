"""Small ShardStates + segment tables laid out as zero/engine.py lays them out, for the
optimizer comparisons (test_fused_adamw.py, test_kernels_gpu.py)."""
from __future__ import annotations

import copy

import torch

from zerompi.device import Placement
from zerompi.optim import build_segments
from zerompi.zero.partition import Chunk, FlatLayout
from zerompi.zero.state import ShardState

NUMELS = (37, 100, 5, 260, 64, 3, 129)
GROUP_OF = (0, 1, 0, 1, 1, 0, 1)
# (param dtype, grad dtype): fp32; bf16/fp16 with same-dtype grads; bf16 with fp32 accumulation
DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
          (torch.bfloat16, torch.float32), (torch.float16, torch.float16)]


def param_groups():
    # group 1: 1 - beta1 >= 0.5 (torch's other lerp form), no weight decay
    return [dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01),
            dict(lr=0.05, betas=(0.3, 0.5), eps=1e-6, weight_decay=0.0)]


def make_state(stage, dtype, grad_dtype, device="cpu", rank=1, world=3, block=48, align=4, seed=0,
               offload=False):
    """(ShardState, segments) of `rank` for `stage`, with random parameters and moments
    (offload: master, moments and a gradient copy in host memory, as offload_optimizer)."""
    layout = FlatLayout(NUMELS, world, block, align)
    own = ([Chunk(k, s, e, s) for k, (s, e) in enumerate(layout.blocks)] if stage == 0
           else layout.chunks(rank))
    st = ShardState(layout, own, Placement.of(device), dtype, grad_dtype,
                    replicated=stage < 3, full_grads=stage < 2, offload=offload)
    gen = torch.Generator().manual_seed(seed)
    full = st.scratch_full32()
    full.copy_(torch.randn(layout.total, generator=gen))
    st.set_full(full)
    for t in (st.exp_avg, st.exp_avg_sq):  # nonzero moments: a mid-training state
        t.copy_(torch.randn(t.numel(), generator=gen).abs() * 1e-3)
    return st, build_segments(layout, own, GROUP_OF)


def set_grads(states, seed, scale=1.0):
    """The same random gradients (several magnitudes, some zeros) into every state."""
    bufs = [st.grad_shard if st.grad_shard is not None else st.flat_grad for st in states]
    gen = torch.Generator().manual_seed(seed)
    n = bufs[0].numel()
    g = torch.randn(n, generator=gen) * torch.exp(torch.empty(n).uniform_(-8, 2, generator=gen))
    g[::17] = 0.0
    for buf in bufs:
        buf.copy_(g * scale)


def clone(st):
    return copy.deepcopy(st)


def buffers_equal(a, b):
    """Names of the buffers whose bits differ between two states."""
    out = []
    for name, t in a.buffers().items():
        u = b.buffers()[name]
        tb, ub = (x.view(torch.int16) if x.element_size() == 2 else x.view(torch.int32) for x in (t, u))
        if not torch.equal(tb.cpu(), ub.cpu()):
            out.append(name)
    return out
