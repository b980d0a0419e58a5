"""Memory beyond the model states: activations (four strategies), the engine's working
buffers, and the largest micro-batch that fits a per-rank budget.

Activations of one transformer layer (Korthikanti et al., "Reducing Activation
Recomputation in Large Transformer Models", 2022, eq. 1-2), in bytes, for sequence s,
micro-batch b, width h, heads a, tensor-parallel degree t, 16-bit activations:

    layer = s b h (10 + 24 / t + 5 a s / (h t))          (t = 1: s b h (34 + 5 a s / h))

fp32 activations double it. The head adds the logits and cross-entropy's fp32 copies:
s b V/t (e + 4 [+ 4 when e = 2: the fp32 upcast]) with e = bytes per activation. The
formula assumes the attention scores (5 a s / h) are stored and dropout masks are kept;
fused attention (SDPA) and dropout = 0 need less, so it is an upper estimate.

  none                  L x layer + head
  checkpoint            every layer keeps only its input (e s b h), and one layer's full
                        set exists during its recomputation: L e s b h + layer + head
  checkpoint+Pa         the kept inputs partitioned over the tp ranks (ZeRO-R Pa):
                        L e s b h / t + layer + head   (= checkpoint at t = 1)
  checkpoint+Pa+offload the kept inputs on the host (Pa + CPU); on the device one
                        layer's set, the head, and two inputs in flight:
                        2 e s b h / t + layer + head;  host: L e s b h / t
The engine implements these modes (parallel/activations.py); the rows here are the
formulas, not measurements.
"""
from __future__ import annotations

import math

from ..parallel.tensor_parallel import padded_vocab_size
from ..zero.stage3 import gather_pool
from .models import ModelSpec

STRATEGIES = ("none", "checkpoint", "checkpoint+Pa", "checkpoint+Pa+offload")


def activation_bytes(spec: ModelSpec, micro_batch: int, precision: str = "bf16", tp: int = 1) -> dict | None:
    """{strategy: {"device": bytes, "host": bytes}} for one micro-batch of `micro_batch`
    sequences of spec.seq tokens; None for a bare parameter count (no shape)."""
    g = spec.gpt
    if g is None:
        return None
    s, b, h, a, L, t = spec.seq, micro_batch, g.n_embd, g.n_head, g.n_layer, tp
    V = g.vocab_size if t == 1 else padded_vocab_size(g.vocab_size, t)  # a tp rank's logits: its padded share
    e = 4 if precision == "fp32" else 2
    layer = e / 2 * s * b * h * (10 + 24 / t + 5 * a * s / (h * t))
    head = s * b * V / t * (e + 4 + (4 if e == 2 else 0))
    kept = e * s * b * h   # one layer's input
    dev = {"none": L * layer + head,
           "checkpoint": L * kept + layer + head,
           "checkpoint+Pa": L * kept / t + layer + head,
           "checkpoint+Pa+offload": 2 * kept / t + layer + head}
    host = {k: 0.0 for k in dev}
    host["checkpoint+Pa+offload"] = L * kept / t
    return {k: {"device": math.ceil(dev[k]), "host": math.ceil(host[k])} for k in STRATEGIES}


def comm_buffer_bytes(layout, bucket_count: int, reduce_bytes: int) -> int:
    """The gradient reducer's constant buffers (grads.GradReducer): min(bucket_count,
    blocks) slots of a largest-block send buffer, its chunk, and (N > 1) the alltoall
    receive space, in the reduce dtype; none for a data-parallel group of one rank (the
    reducer is local). Exact: equals memory_report()["buffers"]."""
    if layout.alone:
        return 0
    B = max(e - s for s, e in layout.blocks)
    c = B // layout.world
    slots = min(bucket_count, len(layout.blocks))
    return slots * (B + c + (B if layout.world > 1 else 0)) * reduce_bytes


def working_bytes(built, stage: int, zcfg, param_bytes: int) -> dict[str, int]:
    """Transient model-state memory besides the partitioned buffers (an estimate):
    - stage 3 'gathered': the gather pool (zero/stage3/gather_pool.py, exact: equals
      memory_report()["gather_pool"]): slots for the unit in use, `prefetch_modules`
      prefetched ones (within max_live_parameters), and every unit enclosing them (the
      model's own unit: embeddings, head), held while what it encloses runs;
      'persistent': the always-gathered small parameters.
    - 'transient_grads': autograd's .grad before its block is reduced (stages 2-3: the
      largest parameter plus bucket_count blocks; stages 0-1 accumulate into flat_grad)."""
    layout = built.layout
    out = {"gathered": 0, "persistent": 0, "transient_grads": 0}
    if layout.alone:  # units are views of the shard, gradients accumulate into it
        return out
    if stage == 3:
        sizes = [(e - s) for s, e in layout.unit_spans]
        flags = built.plan.unit_persistent
        s3 = zcfg.stage3
        slots = gather_pool.capacities(built.plan.unit_names, flags, sizes, s3.prefetch_modules,
                                       s3.max_live_parameters)
        out["gathered"] = sum(slots) * param_bytes
        out["persistent"] = sum(sz for sz, p in zip(sizes, flags) if p) * param_bytes
    if stage >= 2:
        out["transient_grads"] = (max(built.numels) + zcfg.bucket_count * layout.block) * param_bytes
    return out


def largest_micro_batch(budget: int, fixed: int, per_sample: int) -> int:
    """Largest b with fixed + b x per_sample <= budget (0 when even b = 1 does not fit)."""
    if per_sample <= 0:
        return 0
    return max(0, (budget - fixed) // per_sample)
