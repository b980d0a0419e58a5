"""`engine.load_full_state_dict(state_dict)`: full weights (e.g. a transformers
`from_pretrained` model's state_dict) into an engine at any stage, streamed one tensor
at a time. Only rank 0 needs the state dict; the other ranks pass None.

Semantics are those of `with engine.gathered([p], modifier_rank=0): p.copy_(value)` for
each parameter in turn, but the way there is the checkpoint loader's (state_io): rank 0
broadcasts one fp32 tensor, each rank copies the ranges it owns into its fp32 master
(and low-precision copy), and the working parameters are refreshed once at the end
(param_store.after_update). Going through `gathered` instead would all-gather every old
value only to overwrite it, and in bf16/fp16 runs round the loaded fp32 weights to the
working precision before they reach the master. Here the master gets them exactly.

Keys are matched like `model.state_dict()`: every name under which a parameter or
persistent buffer is reachable (tied weights have several; any one of them suffices,
and several must agree); a whole compiled model's keys (`_orig_mod.` first) as the
model's own. Frozen parameters and buffers, replicated on every rank, are
copied as they are. Optimizer moments are left as they are.

Streaming: `state_dict` may be any Mapping whose values are read when asked for (models/
hf_weights.HFCheckpoint: one tensor off disk per lookup) and that tells shapes without
reading (`shape_of(key)`); then no rank holds more than one full tensor beside its share,
and tied keys are not compared (the first one found is loaded). Tensor parallelism: keys
and shapes are the full model's (tp_layout.full_shape); the reading rank cuts this tp
rank's slice (tp_layout.local_index) before it broadcasts, so each tp rank's
data-parallel rank 0 must pass the state dict (any rank may: it is read on rank 0 only).
"""
from __future__ import annotations

from collections import defaultdict
from typing import NamedTuple

import torch
import torch.nn as nn

from ..parallel import tp_layout


class LoadResult(NamedTuple):
    missing_keys: list[str]
    unexpected_keys: list[str]


def _targets(model: nn.Module) -> tuple[dict[str, torch.Tensor], list[list[str]]]:
    """{state_dict key: tensor} and, per distinct tensor in state_dict order, its keys."""
    by_key: dict[str, torch.Tensor] = {}
    keys_of: dict[int, list[str]] = {}
    for prefix, mod in model.named_modules(remove_duplicate=False):
        pre = f"{prefix}." if prefix else ""
        named = [(n, t) for n, t in mod._parameters.items() if t is not None]
        named += [(n, t) for n, t in mod._buffers.items()
                  if t is not None and n not in mod._non_persistent_buffers_set]
        for n, t in named:
            by_key[pre + n] = t
            keys_of.setdefault(id(t), []).append(pre + n)
    return by_key, list(keys_of.values())


def _plan(sd: dict, by_key: dict, groups: list[list[str]], strict: bool):
    """On rank 0: which key loads each tensor (None: not loaded), or an error message."""
    unexpected = [k for k in sd if k not in by_key]
    missing, use = [], []
    for keys in groups:
        present = [k for k in keys if k in sd]
        if not present:
            missing.append(keys[0])
            use.append(None)
            continue
        lazy = hasattr(sd, "shape_of")
        for k in present:
            want, got = tp_layout.full_shape(by_key[k]), tuple(sd.shape_of(k) if lazy else sd[k].shape)
            if want != got:
                return None, f"key '{k}': the checkpoint has shape {got}, the model {want}"
            if not lazy and not torch.equal(sd[k], sd[present[0]]):
                return None, f"keys '{present[0]}' and '{k}' name one (tied) tensor but differ"
        use.append(present[0])
    if strict and (missing or unexpected):
        parts = ([f"missing key(s): {', '.join(missing[:8])}"] if missing else []) + \
                ([f"unexpected key(s): {', '.join(unexpected[:8])}"] if unexpected else [])
        return None, "; ".join(parts) + " (strict=False loads the rest)"
    return (use, missing, unexpected), None


def _own_names(sd):
    """A torch.compile wrapper's state_dict() (every key under `_orig_mod.`) in the
    model's own names, which the engine uses (zero/build.py unwrap_compiled)."""
    wrapped = "_orig_mod."
    if not isinstance(sd, dict) or not any(k.startswith(wrapped) for k in sd):
        return sd
    own = {}
    for k, v in sd.items():
        while k.startswith(wrapped):
            k = k[len(wrapped):]
        own[k] = v
    return own


@torch.no_grad()
def load_full_state_dict(engine, state_dict: dict | None, strict: bool = True) -> LoadResult:
    """See the module docstring. Collective over the engine's data-parallel group."""
    comm = engine.comm
    if engine._backward_pending:
        raise RuntimeError("load_full_state_dict: load between steps, not after backward()")
    by_key, groups = _targets(engine.module)
    msg = plan = None
    if comm.rank == 0:
        if state_dict is None:
            msg = "rank 0 must pass the state dict (the other ranks pass None)"
        else:
            state_dict = _own_names(state_dict)
            plan, msg = _plan(state_dict, by_key, groups, strict)
    plan, msg = comm.bcast_object((plan, msg), root=0)
    if msg is not None:
        raise ValueError(f"zerompi load_full_state_dict: {msg}")
    use, missing, unexpected = plan

    index = {id(p): i for i, p in enumerate(engine.params)}
    segs = defaultdict(list)
    for s in engine.optimizer.segments:
        segs[s.param].append(s)
    st = engine.state
    for keys, key in zip(groups, use):
        if key is None:
            continue
        target = by_key[keys[0]]
        # one tensor at a time, rank 0's values: fp32 (exact for every float dtype we
        # train in), integer buffers in their own dtype
        dt = torch.float32 if target.is_floating_point() else target.dtype
        if comm.rank == 0:
            t = state_dict[key].detach().to("cpu", dt)
            # this tp rank's slice (a copy; padding rows zero), or the whole tensor
            if tp_layout.split_of(target) is not None:
                t = tp_layout.local_index(target, t)
            elif not hasattr(state_dict, "shape_of"):  # a streamed tensor is ours already
                t = t.contiguous().clone()
            else:
                t = t.contiguous()
        else:
            t = torch.empty(target.shape, dtype=dt)
        comm.broadcast(t.view(-1), root=0)
        flat = t.view(-1)
        i = index.get(id(target))
        if i is None:  # frozen parameter or buffer: replicated, copied whole
            target.data.copy_(flat.view(target.shape).to(target.dtype))
            continue
        for s in segs[i]:
            master, _, _, _, lowp = st.views(s.shard_lo, s.flat_lo, s.length)
            master.copy_(flat[s.param_lo:s.param_lo + s.length])
            if lowp is not None:
                lowp.copy_(master)
        del t, flat
    engine.param_store.after_update()  # every rank's working copy from the owners' pieces
    return LoadResult(missing, unexpected)
