"""Engine state <-> checkpoint tensors, by parameter name and element range.

Ranges are in the row-major order of the *full* tensor: a tensor-parallel parameter's
local pieces map onto runs of the full tensor (parallel/tp_layout.py), padding left
out. Each element of every parameter is exported by exactly one rank (stage 0: dp rank 0
holds and writes all; a parameter replicated over tp: tp rank 0; shard groups replicated
over groups, zero.shard_group: the first group), so the checkpoint is
independent of world size, tp size and stage; loading asks each rank for the ranges it
owns now and fills them.
"""
from __future__ import annotations

import torch

from ..parallel import tp_layout
from . import flat

STATE_KINDS = ("param", "exp_avg", "exp_avg_sq")


def _exporting_segments(engine) -> list:
    if (engine.parts.owns_all and engine.rank != 0) or engine.groups.replica_rank != 0:
        return []  # replicas of the same pieces: one rank (group) writes each
    segs = engine.optimizer.segments
    if engine.dims.tp_rank != 0:  # replicas of tp-replicated parameters: tp rank 0 writes
        segs = [s for s in segs if tp_layout.split_of(engine.params[s.param]) is not None]
    return segs


def exported_elements(engine) -> int:
    """Elements of every state kind this rank writes to a checkpoint."""
    return sum(s.length for s in _exporting_segments(engine))


def _runs(engine, s) -> list[tuple[int, int, int]]:
    """(full_lo, full_hi, offset within the segment) of segment s."""
    p = engine.params[s.param]
    return [(flo, fhi, llo - s.param_lo) for flo, fhi, llo in
            tp_layout.full_ranges(tuple(p.shape), tp_layout.split_of(p), s.param_lo, s.param_lo + s.length)]


def _pieces(engine, segments) -> list[tuple[str, tuple, int, int]]:
    return [(engine.param_names[s.param], tp_layout.full_shape(engine.params[s.param]), flo, fhi)
            for s in segments for flo, fhi, _ in _runs(engine, s)]


def export_state(engine, views: bool = False) -> dict:
    """This rank's share of the training state: {"pieces": [(name, shape, lo, hi)],
    "tensors": {kind: fp32 vector}} where piece j's values are
    tensors[kind][off_j : off_j + hi - lo] (offsets cumulative), plus "steps"
    {name: AdamW step}, "param_groups", "scaler", "counters". views=True gives
    {kind: [piece j's values]} instead: views of the engine's own buffers, no copy
    (the checkpoint writer streams them to disk; a concatenation of a large shard
    would cost seconds of page faults)."""
    segs = _exporting_segments(engine)
    cols: dict[str, list] = {kind: [] for kind in STATE_KINDS}
    for s in segs:
        master, _, exp_avg, exp_avg_sq, _ = engine.state.views(s.shard_lo, s.flat_lo, s.length)
        for flo, fhi, off in _runs(engine, s):
            for kind, t in zip(STATE_KINDS, (master, exp_avg, exp_avg_sq)):
                cols[kind].append(t.detach()[off:off + fhi - flo].float())
    tensors = cols if views else {kind: torch.cat(ts) if ts else torch.empty(0) for kind, ts in cols.items()}
    opt = engine.optimizer
    return {"pieces": _pieces(engine, segs), "tensors": tensors,
            "steps": {n: opt.steps[i] for i, n in enumerate(engine.param_names)},
            "param_groups": opt.hyper_state()["param_groups"],
            "scaler": engine.scaler.state_dict(),
            "counters": {"global_steps": engine.global_steps, "micro_steps": engine.micro_steps,
                         "skipped_steps": engine.skipped_steps}}


def needed_pieces(engine) -> list[tuple[str, tuple, int, int]]:
    """(name, shape, lo, hi) of every parameter range this rank must load."""
    return _pieces(engine, engine.optimizer.segments)


def _fill(fetch, kind: str, name: str, lo: int, hi: int, dst: torch.Tensor) -> None:
    """dst = values [lo, hi) of `kind` of `name`. Host fp32 destinations are filled in
    place (fetch(..., out=dst)): no temporary the size of the range, whose fresh pages
    and second copy cost 0.08 s of a 1.6 GB load on the 2-core VM; others get a copy."""
    if dst.device.type == "cpu" and dst.dtype == torch.float32 and dst.is_contiguous():
        got = fetch(kind, name, lo, hi, out=dst)
        if got is not dst:
            dst.copy_(got)
    else:
        dst.copy_(fetch(kind, name, lo, hi))


def import_state(engine, fetch, steps: dict, param_groups: list, scaler: dict, counters: dict) -> None:
    """Load state saved by export_state (any world size or stage): fetch(kind, name,
    lo, hi, out=None) returns the fp32 values of that range (in `out`, a host fp32
    tensor, when given). Then refreshes every rank's working
    parameters from the owners' masters."""
    if engine._backward_pending:
        raise RuntimeError("load the checkpoint between steps, not after backward()")
    for s in engine.optimizer.segments:
        master, _, exp_avg, exp_avg_sq, lowp = engine.state.views(s.shard_lo, s.flat_lo, s.length)
        name, runs = engine.param_names[s.param], _runs(engine, s)
        for kind, dst in zip(STATE_KINDS, (master, exp_avg, exp_avg_sq)):
            if len(runs) != 1 or runs[0][1] - runs[0][0] != s.length:
                dst.zero_()  # tp padding (a vocabulary padded to 128 x tp) stays zero
            for flo, fhi, off in runs:
                _fill(fetch, kind, name, flo, fhi, dst[off:off + fhi - flo])
        if lowp is not None:
            lowp.copy_(master)
    opt = engine.optimizer
    opt.load_hyper_state({"steps": [int(steps[n]) for n in engine.param_names], "param_groups": param_groups})
    engine.scaler.load_state_dict(scaler)
    engine._global_steps = int(counters["global_steps"])  # settled first (ZeroEngine.import_state)
    engine.micro_steps = int(counters["micro_steps"])
    engine._skipped_steps = int(counters.get("skipped_steps", 0))
    # Ranks finish their reads at different times; spinning in the all-gather's MPI wait
    # would take the cores of ranks still reading when ranks outnumber cores.
    engine.dims.world.barrier(poll=True)
    engine.param_store.after_update()
    engine._zero_grads()


def full_grads(engine) -> dict[str, torch.Tensor]:
    """The reduced, unscaled fp32 gradient of the global batch, keyed by parameter
    name, on every rank. Valid after the boundary micro-step's backward and before
    step() (for debugging and tests; it materialises the whole gradient)."""
    st, comm, layout = engine.state, engine.groups.shard, engine.layout
    if engine.parts.owns_all:
        full = st.flat_grad.float()
    else:
        gathered = st.placement.empty(comm.size * layout.shard_size, torch.float32)
        comm.all_gather(st.grad_shard_fp32(), gathered)
        full = flat.unshard(gathered.view(comm.size, -1), layout)
    full = full * (engine.reducer.unapplied / engine.scaler.scale)  # local: the mean, not the sum
    return {n: full[o:o + k].view(p.shape).clone() for n, p, o, k in
            zip(engine.param_names, engine.params, layout.offsets, layout.numels)}
