"""Stage-3 units: which parameters are gathered together, and when.

A unit is a module subtree (FSDP-style): when the unit's root module runs, every
parameter of the subtree that belongs to no nested unit is gathered, so a parameter
read anywhere inside the root's forward or backward is present - including reads that
bypass the owning module (nn.MultiheadAttention reading out_proj.weight through
F.multi_head_attention_forward, a parent calling F.linear(x, self.child.weight),
mixture-of-experts layers calling only some experts).

Unit roots (`stage3.unit_classes`, `stage3.unit_min_elements`):
  - the model itself (everything no other unit claims: embeddings, final norm, head);
  - "auto": the repeated blocks - children of an nn.ModuleList / nn.Sequential whose
    class occurs more than once there (transformer layers of GPT, BERT, T5, Llama,
    Mixtral, nn.TransformerEncoder), outermost only, so an expert list inside a layer
    stays part of its layer's unit; or an explicit list of class names (nesting allowed);
  - with unit_min_elements > 0, also any other module whose unclaimed subtree holds at
    least that many elements (FSDP's size-based policy).
A parameter registered by modules of several units (tied weights) belongs to their
nearest common enclosing unit. Parameters of at most `persistence_threshold` elements
form one persistent unit that stays gathered.

Coalescing (`stage3.coalesce_elements`, `coalesce_target`): at large N a unit's chunk
per rank (unit elements / N) can be too small for its collectives to be efficient (a
201M-element layer of a 7.5B GPT at N = 4096: 49K elements). Consecutive sibling units
(roots with the same parent, e.g. h.0, h.1, ... of a ModuleList, enclosing no other
unit) are then merged into one unit with several roots while the group holds fewer than
the target; a group left below it at the end of a run of siblings joins the previous
group. The model's own unit, when below the target, takes in the leaf units that follow
it in module order (it is gathered for the whole forward and backward anyway). A merged
unit is gathered when any of its roots runs and released after the forward of its last
root - the enclosing one, listed last, when the model's unit is among them
(store.py).
"""
from __future__ import annotations


import torch
import torch.nn as nn

from ...models.blocks import is_within as _is_within, repeated_blocks
from ..params import Plan

PERSISTENT = "<persistent>"


class Unit:
    """One unit at run time: its span of the flat space, its gathered buffer and state
    (store.py gathers and releases it)."""

    def __init__(self, idx: int, name: str, roots, params: list[int], blocks: range,
                 span: tuple[int, int], persistent: bool):
        self.idx, self.name, self.params, self.blocks = idx, name, params, blocks
        self.roots = tuple(roots or ())  # modules whose forward gathers it (several: coalesced)
        self.lo, self.hi = span
        self.persistent = persistent
        self.full: torch.Tensor | None = None
        self.slot = None     # the pool slot lent to `full` while gathered
        self.state = "free"  # free | inflight | ready
        self.handles: list = []
        self.fill = False    # a primary gather in flight whose values the secondary copy keeps
        self.pending = 0     # parameters whose gradient has not accumulated yet

    @property
    def size(self) -> int:
        return self.hi - self.lo


def free_storage(t: torch.Tensor) -> None:
    """A released unit's buffer keeps its shape and views, with no memory behind them."""
    t.untyped_storage().resize_(0)


def alloc_storage(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(t.numel() * t.element_size())


def unit_roots(model: nn.Module, stage3) -> list[str]:
    """Qualified names of the unit roots ("" is the model), in module order."""
    modules = dict(model.named_modules(remove_duplicate=False))
    roots: list[str] = [""]
    classes = stage3.unit_classes.strip()
    if classes == "auto":
        roots += repeated_blocks(model)
    else:
        wanted = {c.strip() for c in classes.split(",")}
        roots += [n for n, m in modules.items() if n and type(m).__name__ in wanted]
    if stage3.unit_min_elements > 0:
        roots += _size_roots(model, set(roots), stage3.unit_min_elements)
    seen, out = set(), []
    for n in modules:  # module order, each root once
        if n in roots and n not in seen:
            seen.add(n)
            out.append(n)
    return out


def _size_roots(model: nn.Module, roots: set[str], threshold: int) -> list[str]:
    """Post-order: a module whose not-yet-claimed subtree holds >= threshold elements."""
    out: list[str] = []

    def visit(name: str, mod: nn.Module) -> int:
        total = sum(p.numel() for p in mod.parameters(recurse=False) if p.requires_grad)
        for k, child in mod.named_children():
            cname = f"{name}.{k}" if name else k
            sub = visit(cname, child)
            total += 0 if cname in roots or cname in out else sub
        if name and name not in roots and total >= threshold:
            out.append(name)
        return total

    visit("", model)
    return out


def coalesce_target(stage3, bucket: int, at_least: bool) -> int:
    """Elements below which sibling units are merged: stage3.coalesce_elements, its
    "auto" being the bucket when the bucket is a floor on the chunk (at_least: bucket_size
    "auto" above 2^22, zero/engine.py bucket_policy), else 0 (no merging)."""
    c = stage3.coalesce_elements
    if c == "auto":
        return int(bucket) if at_least else 0
    return int(c)


def _parent(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ""


def _numel(ps: list) -> int:
    return sum(p.numel() for _, p in ps)


def coalesce(groups: list[tuple[str, list]], target: int) -> list[tuple[list[str], list]]:
    """Merge consecutive sibling units (module order) below `target` elements.
    groups: [(root name, [(name, param)])] in module order; returns [(root names, params)]."""
    names = [r for r, _ in groups]
    leaf = {r: r != "" and not any(o != r and o.startswith(r + ".") for o in names) for r in names}
    out: list[tuple[list[str], list]] = []
    groups = list(groups)
    if target > 0 and groups and groups[0][0] == "" and _numel(groups[0][1]) < target:
        # The model's own unit (embeddings, head) is gathered for the whole forward and
        # backward anyway; the leaf units that follow it join it until it reaches the
        # target (enclosing root last: its forward ends last, so it releases).
        roots, ps = [], list(groups[0][1])
        while len(groups) > 1 and leaf[groups[1][0]] and _numel(ps) < target:
            r, more = groups.pop(1)
            roots.append(r)
            ps.extend(more)
        out.append((roots + [""], ps))
        groups.pop(0)
    for r, ps in groups:
        last = out[-1] if out else None
        if (target > 0 and last is not None and leaf[r] and last[0][-1] != "" and leaf[last[0][0]]
                and _parent(r) == _parent(last[0][0]) and _numel(last[1]) < target):
            last[0].append(r)
            last[1].extend(ps)
        else:
            _close(out, target, leaf)
            out.append(([r], list(ps)))
    _close(out, target, leaf)
    return out


def _close(out: list, target: int, leaf: dict) -> None:
    """A finished group still below target joins the previous group of the same siblings."""
    if target <= 0 or len(out) < 2:
        return
    (roots, ps), (proots, pps) = out[-1], out[-2]
    if (_numel(ps) < target and leaf[roots[0]] and proots[-1] != "" and leaf[proots[0]]
            and _parent(roots[0]) == _parent(proots[0])):
        out.pop()
        proots.extend(roots)
        pps.extend(ps)


def plan(model: nn.Module, trainable: list, cfg, coalesce_below: int = 0) -> Plan:
    """Flat order (units in backward order, each unit's parameters in reverse
    registration order) and the units of stage 3; with coalesce_below > 0 consecutive
    sibling units smaller than that are merged (`coalesce`)."""
    s3 = cfg.stage3
    roots = unit_roots(model, s3)
    names = {id(p): n for n, p in trainable}
    users: dict[int, list[str]] = {}
    for mname, mod in model.named_modules(remove_duplicate=False):
        for p in mod.parameters(recurse=False):
            if id(p) in names:
                users.setdefault(id(p), []).append(mname)

    def root_of(mname: str) -> str:
        return max((r for r in roots if _is_within(mname, r)), key=len)

    members: dict[str, list] = {r: [] for r in roots}
    persistent = []
    for n, p in trainable:
        if p.numel() <= s3.persistence_threshold:
            persistent.append((n, p))
            continue
        owners = {root_of(m) for m in users[id(p)]}
        home = _common_root(owners, roots)
        members[home].append((n, p))
    groups = coalesce([(r, ps) for r, ps in members.items() if ps], coalesce_below)
    units = [(rs, ps[::-1]) for rs, ps in groups][::-1]  # backward order
    if persistent:
        units.append(([PERSISTENT], persistent[::-1]))
    modules = dict(model.named_modules(remove_duplicate=False))

    def label(rs: list[str]) -> str:
        return "+".join(r if r != "" else "<root>" for r in rs)

    return Plan(order=[np for _, ps in units for np in ps], unit_sizes=[len(ps) for _, ps in units],
                unit_names=[label(rs) for rs, _ in units],
                unit_persistent=[rs == [PERSISTENT] for rs, _ in units],
                unit_roots=[None if rs == [PERSISTENT] else tuple(modules[r] for r in rs) for rs, _ in units],
                model=model)


def _common_root(owners: set[str], roots: list[str]) -> str:
    """The innermost unit root enclosing every root in `owners`."""
    if len(owners) == 1:
        return owners.pop()
    parts = [o.split(".") if o else [] for o in owners]
    prefix = []
    for segs in zip(*parts):
        if len(set(segs)) != 1:
            break
        prefix.append(segs[0])
    while prefix and ".".join(prefix) not in roots:
        prefix.pop()
    return ".".join(prefix)


def explain_released_read(exc: BaseException, released: dict, model: nn.Module,
                          unit_classes: str) -> Exception | None:
    """torch reports a read of a released parameter only as an empty storage. Our error
    names the module that read it (the innermost model module on the traceback), the
    parameter when a frame holds it (else the released ones under the reader), and the
    config key to change. `released`: id(param) -> (name, unit name). None: not that error."""
    if "storage of size 0" not in str(exc):
        return None
    names = {id(m): n for n, m in model.named_modules()}
    reader, hit, frames, tb = None, None, [], exc.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    for f in reversed(frames):  # innermost first
        for v in f.f_locals.values():
            if hit is None and isinstance(v, torch.Tensor) and id(v) in released:
                hit = released[id(v)]
        mod = f.f_locals.get("self")
        if reader is None and isinstance(mod, nn.Module) and id(mod) in names:
            reader = mod
    where = f"module '{names[id(reader)]}' ({type(reader).__name__})" if reader else "the model"
    what = f"parameter '{hit[0]}' of unit '{hit[1]}'" if hit else "a released parameter"
    if hit is None and reader is not None:
        inside = [released[id(p)][0] for p in reader.parameters() if id(p) in released]
        if inside:
            what = "a released parameter (released now, under it: " + ", ".join(inside[:4]) + ")"
    cls = type(reader).__name__ if reader is not None else "<the reading module's class>"
    return RuntimeError(
        f"zerompi stage 3: {where} read {what} outside the unit that gathers it (a unit's "
        f"parameters are present only while the unit's root module runs). Make one unit "
        f"cover the reader: add '{cls}' to zero.stage3.unit_classes (now {unit_classes!r}), "
        f"or keep small parameters resident with zero.stage3.persistence_threshold")


def output_tensors(obj):
    """The tensors in a module's output (nested lists, tuples, dicts)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from output_tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from output_tensors(o)
