"""Skeleton GPTs for the host proxy (bench_host_proxy.py): the real preset's structure at
tiny widths, laid out by the engine into the same number of parameters, pieces, blocks and
(stage 3) units, block counts per unit included: the engine's host work per step loops over
blocks (a bucket, a collective each), pieces (a copy each) and units (gathers, hooks,
rounds), so a skeleton with those counts repeats it while its compute is negligible.

The real model is laid out on the `meta` device by the engine's own builder (zero/layout.py),
its bucket resolved as for a GPU run. A skeleton (width c, vocabulary V, context T, the real
depth) is searched whose plan order is the real one and for which an integer
zero.bucket_size gives every unit the real number of blocks and pieces at every (stage,
world); zero.alignment drops to 1 when no width works at the engine's (alignment moves no
host work). Each engine bench_host_proxy.py builds is checked against it (`engine_signature`).
"""
from __future__ import annotations

import dataclasses
from functools import lru_cache

import numpy as np

from harness import ROOT  # noqa: F401  (puts this checkout's zerompi first on sys.path)
from zerompi.config import ZeroConfig
from zerompi.estimate.models import on_meta
from zerompi.models.gpt import GPT, PRESETS, GPTConfig, count_params
from zerompi.zero import layout as zlayout
from zerompi.zero.partition import FlatLayout

WIDTHS = range(16, 129, 16)   # skeleton n_embd candidates, smallest first


@dataclasses.dataclass(frozen=True)
class Skeleton:
    preset: str
    real: GPTConfig
    gpt: GPTConfig                       # the skeleton's shape
    alignment: int                       # zero.alignment of the skeleton's engines
    buckets: dict                        # (stage, world) -> integer zero.bucket_size
    real_buckets: dict                   # (stage, world) -> (elements, at_least) of the real run
    signatures: dict                     # (stage, world) -> signature (both models)

    def zero_overrides(self, stage: int, world: int) -> dict:
        """Config keys of the skeleton's engine (merged into the run's engine config). A
        real bucket above the "auto" floor coalesces stage-3 units (units.coalesce_target);
        the skeleton's integer bucket would not, so it asks for the same rule explicitly."""
        b = self.buckets[(stage, world)]
        out = {"bucket_size": b, "alignment": self.alignment}
        if stage == 3 and self.real_buckets[(stage, world)][1]:
            out["stage3"] = {"coalesce_elements": b}
        return out

    def describe(self) -> dict:
        g = self.gpt
        return {"preset": self.preset, "n_embd": g.n_embd, "vocab_size": g.vocab_size, "block_size": g.block_size,
                "n_layer": g.n_layer, "n_head": g.n_head, "alignment": self.alignment,
                "params": count_params(g),
                "buckets": {f"stage{s}_n{w}": b for (s, w), b in sorted(self.buckets.items())},
                "real_buckets": {f"stage{s}_n{w}": list(b) for (s, w), b in sorted(self.real_buckets.items())},
                "signatures": {f"stage{s}_n{w}": sig_dict(v) for (s, w), v in sorted(self.signatures.items())}}


def sig_dict(sig: tuple) -> dict:
    params, unit_blocks, pieces = sig
    return {"params": params, "pieces": pieces, "blocks": sum(unit_blocks), "units": len(unit_blocks),
            "blocks_per_unit": list(unit_blocks)}


def signature(layout: FlatLayout, fast: bool = False) -> tuple:
    """(parameters, blocks per unit, pieces) of a layout: what the skeleton must share.
    Pieces are layout.pieces' over every block; fast: counted as the blocks each
    non-empty parameter spans (the same number, for the search)."""
    if fast:
        bo = layout.block_of
        pieces = sum(bo(o + n - 1) - bo(o) + 1 for o, n in zip(layout.offsets, layout.numels) if n)
    else:
        pieces = sum(len(layout.pieces(s, e)) for s, e in layout.blocks)
    return len(layout.numels), tuple(len(r) for r in layout.unit_blocks), pieces


def engine_signature(engine) -> tuple:
    return signature(engine.layout)


def _coefficients(name: str) -> tuple[int, int, int, int]:
    """(c^2, c, vocab*c, block*c) coefficients of GPT parameter `name`'s element count at
    width c (models/gpt.py's shapes)."""
    if name.endswith("wte.weight"):
        return 0, 0, 1, 0
    if name.endswith("wpe.weight"):
        return 0, 0, 0, 1
    for suffix, k in (("c_attn.weight", (3, 0)), ("c_attn.bias", (0, 3)), ("attn.c_proj.weight", (1, 0)),
                      ("c_fc.weight", (4, 0)), ("c_fc.bias", (0, 4)), ("mlp.c_proj.weight", (4, 0))):
        if name.endswith(suffix):
            return k[0], k[1], 0, 0
    return 0, 1, 0, 0  # layer norms, the other biases


def _block_range(numels, units, world: int, align: int, unit_nb) -> int | None:
    """The smallest integer bucket (a multiple of world x align) giving each unit span
    exactly unit_nb[u] blocks (partition.split_span: nb = ceil(q / b)), or None."""
    lay = FlatLayout(numels, world, 1 << 40, align, units=units)
    u = world * align
    lo, hi = 1, 1 << 40
    for (s, e), nb in zip(lay.unit_spans, unit_nb):
        q = (e - s) // u
        lo = max(lo, -(-q // nb))
        if nb > 1:
            hi = min(hi, -(-q // (nb - 1)) - 1)
    return lo * u if lo <= hi else None


def _plans(model, cfg_of, stages, worlds):
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    out = {}
    for s in stages:
        cfg = cfg_of(s)
        for w in worlds:
            b, at_least = zlayout.bucket(cfg, w, s, device="cuda")  # the real run's, on a GPU
            plan = zlayout.plan(model, trainable, cfg, s, b, at_least)
            out[(s, w)] = (plan, (b, at_least), signature(zlayout.flat_layout(plan, w, cfg, b, at_least), fast=True))
    return out


@lru_cache(maxsize=None)
def find(preset: str, stages: tuple = (0, 1, 2, 3), worlds: tuple = (1, 2, 4),
         base: ZeroConfig | None = None) -> Skeleton:
    """The smallest skeleton of `preset` whose layouts match the real model's (see above)."""
    real = PRESETS[preset]
    base = base or ZeroConfig(precision="bf16")
    cfg_of = lambda s: dataclasses.replace(base, stage=s)  # noqa: E731
    with on_meta():
        plans = _plans(GPT(real), cfg_of, stages, worlds)
    # one check per distinct (order, units, world, target): stages 0-2 mostly share one
    checks: dict = {}
    for (s, w), (plan, _, want) in plans.items():
        names = tuple(n for n, _ in plan.order)
        key = (names, tuple(plan.unit_sizes or ()), w, want)
        if key not in checks:
            checks[key] = [[], np.array([_coefficients(n) for n in names]), plan.unit_sizes, w, want]
        checks[key][0].append((s, w))
    checks = list(checks.values())
    for c in WIDTHS:
        vocabs = _around(real.vocab_size * c / real.n_embd)
        blocks = range(4, max(8, 2 * round(real.block_size * c / real.n_embd)) + 1, 4)
        for align in dict.fromkeys((base.alignment, 1)):
            for t in blocks:
                for v in vocabs:
                    got = _try(checks, c, v, t, align)
                    if got is not None:
                        gpt = GPTConfig(vocab_size=v, block_size=t, n_layer=real.n_layer, n_head=2, n_embd=c)
                        return Skeleton(preset, real, gpt, align, got, {k: p[1] for k, p in plans.items()},
                                        {k: p[2] for k, p in plans.items()})
    raise RuntimeError(f"host proxy: no skeleton of {preset} up to n_embd {WIDTHS[-1]} has the real layout's "
                       f"counts {[sig_dict(p[2]) for p in plans.values()][:2]}...: widen WIDTHS")


def _around(x: float) -> list[int]:
    lo, hi = max(2, int(x * 0.5)), int(x * 1.5) + 2
    step = max(1, (hi - lo) // 60)
    return list(range(lo, hi + 1, step))


def _try(checks: list, c: int, vocab: int, block: int, align: int) -> dict | None:
    buckets = {}
    for keys, coef, units, w, want in checks:
        numels = (coef @ np.array([c * c, c, vocab * c, block * c])).tolist()
        b = _block_range(numels, units, w, align, want[1])
        if b is None or signature(FlatLayout(numels, w, b, align, units=units), fast=True) != want:
            return None
        buckets.update(dict.fromkeys(keys, b))
    return buckets


def merged(base: dict, over: dict) -> dict:
    """base with over's keys set (nested dicts merged)."""
    out = dict(base)
    for k, v in over.items():
        out[k] = merged(out.get(k) or {}, v) if isinstance(v, dict) else v
    return out

