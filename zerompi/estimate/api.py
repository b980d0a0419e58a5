"""The estimator as functions (the CLI calls these; each returns plain, JSON-ready data).

    from zerompi.estimate import api
    api.table1()                                         # the paper's Table 1
    api.formulas(7.5e9, dps=[1, 64, 1024])               # model states per rank, every stage
    api.size("gpt-7.5b", dps=[1024], stages=[3], mem_per_rank=80 * 2**30, link="hdr-ib")
    api.dry_run("gpt-1t", dps=[4096])                    # the engine's real layout at N ranks
    api.size("gpt-7.5b", dps=[1024], stages=[3], ranks_per_node=8, link="ndr-ib")  # + across nodes

`model` is a preset name (models.ALL_SHAPES), a zerompi.trainer.config TrainConfig, a
TOML/JSON path of one, or a models.ModelSpec.
"""
from __future__ import annotations

import dataclasses
import math
import resource
import time
from typing import NamedTuple, Sequence

from ..trainer import config as train_config
from ..config import ZeroConfig
from ..zero.buckets import auto_elem_bytes, bucket_policy
from ..comm import cost_model
from . import hierarchy as hier, memory, models
from .dryrun import DryRun, dry_run as _dry_run
from .sizing import size_run

STAGES = (0, 1, 2, 3)


def table1() -> list[dict]:
    return memory.table1()


def _precision_label(precision: str, gdt: str) -> str:
    if precision == "fp32":
        return "fp32 training with Adam (p = g = 4, K = 8)"
    g = "fp32 gradients (grad_accum_dtype = fp32: g = 4)" if gdt == "fp32" else "gradients in the param dtype"
    return f"{precision} mixed precision, fp32 master + Adam (K = 12), {g}"


def _check(dps: Sequence[int], stages: Sequence[int], tp: int, gas: int = 1) -> None:
    if not dps:
        raise ValueError("--dp: give at least one N")
    for n in dps:
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"--dp: every N must be an integer >= 1 (got {n!r})")
    for s in stages:
        if s not in STAGES:
            raise ValueError(f"--stage: {s!r} is not a ZeRO stage (0, 1, 2 or 3)")
    if tp < 1:
        raise ValueError(f"--tp must be >= 1 (got {tp})")
    if gas < 1:
        raise ValueError(f"--gas must be >= 1 (got {gas})")


def formulas(psi: float, dps: Sequence[int] = memory.TABLE1_DP, stages: Sequence[int] = STAGES,
             precision: str = "bf16", grad_accum_dtype: str = "param", tp: int = 1) -> dict:
    """Per-rank model-state bytes from the paper's formulas for every N and stage."""
    _check(dps, stages, tp)
    if not psi >= 1:
        raise ValueError(f"--params must be >= 1 (got {psi})")
    rows = memory.model_state_rows(int(round(psi)), dps, stages, precision, grad_accum_dtype, tp)
    return {"mode": "formulas", "psi": int(round(psi)), "tp": tp, "precision": precision,
            "grad_accum_dtype": grad_accum_dtype, "precision_label": _precision_label(precision, grad_accum_dtype),
            "rows": rows}


def resolve_model(model, seq_len: int = 0) -> tuple[models.ModelSpec, ZeroConfig | None, int | None]:
    """(spec, the config's ZeroConfig or None, the config's global batch or None)."""
    if isinstance(model, models.ModelSpec):
        return (model if not seq_len else models.ModelSpec(model.name, model.psi, model.gpt, seq_len)), None, None
    if isinstance(model, train_config.TrainConfig) or (isinstance(model, str) and
                                                       model.endswith((".toml", ".json"))):
        tc = model if isinstance(model, train_config.TrainConfig) else train_config.load(model)
        spec = models.from_train_config(tc)
        if seq_len:
            spec = models.ModelSpec(spec.name, spec.psi, spec.gpt, seq_len)
        return spec, tc.zero, tc.global_batch
    spec = models.from_preset(str(model))
    return (models.ModelSpec(spec.name, spec.psi, spec.gpt, seq_len) if seq_len else spec), None, None


def resolve_link(link=None, alpha: float | None = None, beta: float | None = None):
    if isinstance(link, cost_model.Link):
        return link
    if link is None and alpha is None and beta is None:
        link = cost_model.DEFAULT_AUTO_LINK
    return cost_model.resolve_link(link, alpha, beta)


def _settings(zcfg: ZeroConfig, precision: str, gdt: str, gas: int, tp: int, bucket) -> str:
    b = bucket or zcfg.bucket_size
    if b == "auto":  # sized for the narrowest collective: the param dtype's all-gather in bf16/fp16
        b = (f"auto (grows with N, sized for {auto_elem_bytes(precision, zcfg.reduce_dtype, 1)}-byte "
             "elements, the narrowest collective's at stages 1-3 (stage 0: the reduce dtype's): "
             "zero.buckets.auto_bucket_elements)")
    else:
        b = f"{b:,} elements"
    return (f"{_precision_label(precision, gdt)}; bucket_size {b}, bucket_count "
            f"{zcfg.bucket_count}, alignment {zcfg.alignment}, reduce_dtype {zcfg.reduce_dtype}, GAS {gas}, tp {tp}")


def _bucket_at(bucket, n: int, zcfg: ZeroConfig, precision: str, link, stage: int) -> "int | str | tuple | None":
    if bucket != "auto" or link is None:
        return bucket  # None: the config's; "auto" without a link: the engine's own rule
    return bucket_policy("auto", n, elem_bytes=auto_elem_bytes(precision, zcfg.reduce_dtype, stage), link=link)


def placement(dps: Sequence[int], ranks_per_node: int | None = None, nodes: int | None = None,
              tp: int = 1) -> dict | None:
    """{N: data-parallel ranks per node} for every N of data-parallel ranks (block
    placement): `ranks_per_node` P, every rank of the node counted, or `nodes` K; None
    without either (one node). With tp T the node's P ranks are P / T whole tp groups
    (ParallelDims: ranks r // T share one), so a data-parallel group has P / T on each."""
    if ranks_per_node is None and nodes is None:
        return None
    if ranks_per_node is not None and nodes is not None:
        raise ValueError("--ranks-per-node P and --nodes K say the same (P = N x tp / K): give one")
    flag, v = ("--nodes", nodes) if nodes is not None else ("--ranks-per-node", ranks_per_node)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{flag} must be an integer >= 1 (got {v!r})")
    if nodes is not None:
        bad = [n for n in dps if n % nodes]
        if bad:
            raise ValueError(f"--nodes {v}: must divide every N of --dp (not {bad[0]})")
        return {n: n // nodes for n in dps}
    if v % tp:
        raise ValueError(f"--ranks-per-node {v}: a node must hold whole tp groups of tp {tp} "
                         "(consecutive ranks share a tp group)")
    bad = [n for n in dps if n % (v // tp)]
    if bad:
        raise ValueError(f"--ranks-per-node {v} does not divide N = {bad[0]}"
                         + (f" data-parallel ranks (x tp {tp})" if tp > 1 else ""))
    return {n: v // tp for n in dps}


def with_mode(zcfg: ZeroConfig, shard_group=None, hierarchical: str | None = None, secondary_partition=None):
    """zcfg with the hierarchy keys given replaced (checked by the config itself)."""
    if shard_group is None and hierarchical is None and secondary_partition is None:
        return zcfg
    return dataclasses.replace(
        zcfg, shard_group=zcfg.shard_group if shard_group is None else shard_group,
        comm=dataclasses.replace(zcfg.comm, hierarchical=hierarchical or zcfg.comm.hierarchical),
        stage3=dataclasses.replace(zcfg.stage3, secondary_partition=zcfg.stage3.secondary_partition
                                   if secondary_partition is None else secondary_partition))


def _link_dict(link) -> dict:
    return {"name": link.name, "alpha": link.alpha, "beta": link.beta}


def _across(runs: list[dict], runner, per: dict, zcfg: ZeroConfig, precision: str, gas: int, gdt: str,
            buckets: list, inter, intra_link, nics: int | None, modes: dict | None) -> dict:
    """Each run's own mode across nodes (run["nodes"]) and every mode compared. With tp
    T a node's T data-parallel groups (one per tp rank) run the same collectives at the
    same moments, so each gets 1/T of the node's links."""
    if nics is not None and (isinstance(nics, bool) or not isinstance(nics, int) or nics < 1):
        raise ValueError(f"--nics-per-node must be an integer >= 1 (got {nics!r})")
    intra = resolve_link(intra_link)
    own, out = hier.settings_of(zcfg), []
    share = None if nics is None else nics / runner.tp
    for run, b in zip(runs, buckets):
        run["nodes"], priced = hier.compare(runner, run["N"], per[run["N"]], run["stage"], own, precision, gas,
                                            gdt, b, inter, intra, share, modes)
        for d in {id(d): d for d in [run["nodes"], *priced]}.values():
            _whole_nodes(d, runner.tp)
        out += priced
    return {"inter": _link_dict(inter), "intra": _link_dict(intra), "nics_per_node": nics, "tp": runner.tp,
            "own": own, "modes": out}


def _whole_nodes(d: dict, tp: int) -> None:
    """hierarchy.price's figures are one data-parallel group's; a node carries tp of
    them at once: its links' bytes and the job's bytes across count all, and the group's
    share of the links (what it was priced with) is kept apart. Per-rank figures and the
    rows (one group's sub-collectives) stay as priced."""
    d["tp"], d["nics_per_group"] = tp, d["nics_per_node"]
    d["nics_per_node"] = d["nics_per_group"] * tp
    d["node_link_bytes"] *= tp
    d["cross_bytes_total"] *= tp


def size(model, dps: Sequence[int] = memory.TABLE1_DP, stages: Sequence[int] | None = None, *,
         precision: str | None = None, grad_accum_dtype: str | None = None, gas: int | None = None,
         tp: int | None = None, bucket: "int | str | None" = None, micro_batch: int | None = None,
         seq_len: int = 0, mem_per_rank: int | None = None, link=None, alpha=None, beta=None,
         zero: ZeroConfig | None = None, ranks_per_node: int | None = None, nodes: int | None = None,
         nics_per_node: int | None = None, intra_link="nvlink", shard_group=None, hierarchical=None,
         secondary_partition=None, modes: dict | None = None) -> dict:
    """Every rank's memory (model states, buffers, working memory, activations), the
    largest micro-batch per activation strategy, and the collectives of one step with
    their predicted time, for a concrete model at each N and stage. Settings not given
    come from the model's TrainConfig (zero.*: its stage), else ZeroConfig defaults in bf16
    (every stage); shard_group, hierarchical, secondary_partition override its zero.*.
    With ranks_per_node P (or nodes K: P = N / K) the ranks sit on nodes, `link` is the
    link between them (one of the node's nics_per_node, default one per rank) and
    `intra_link` the one inside: each run gets "nodes", what its own mode moves inside
    and across nodes per step and the time (hierarchy.py), and "nodes" lists it with every
    mode of `modes` (default hierarchy.MODES; {} for none)."""
    spec, zcfg_cfg, global_batch, zcfg, precision, gdt, gas, tp = _resolve(
        model, seq_len, zero, (shard_group, hierarchical, secondary_partition), precision, grad_accum_dtype, gas, tp)
    stages = list(stages) if stages else ([zcfg.stage] if zcfg_cfg or zero else list(STAGES))
    _check(dps, stages, tp, gas)
    memory.element_bytes(precision, gdt)
    if micro_batch is not None and micro_batch < 1:
        raise ValueError(f"--micro-batch must be >= 1 (got {micro_batch})")
    lk = resolve_link(link, alpha, beta)
    per = placement(dps, ranks_per_node, nodes, tp)
    runner = DryRun(spec, zcfg, tp)
    mode = (zcfg.shard_group, zcfg.comm.hierarchical, zcfg.stage3.secondary_partition)
    runs, buckets = [], []
    for n in dps:
        for s in stages:
            b = _bucket_at(bucket, n, zcfg, precision, lk, s)
            plan = hier.plan_for(n, per[n] if per else None, s, *mode)
            buckets.append(b)
            runs.append(size_run(spec, runner, n, stage=s, precision=precision, grad_accum_dtype=gdt, gas=gas,
                                 tp=tp, bucket=b, micro_batch=micro_batch,
                                 global_batch=None if micro_batch else global_batch, mem_per_rank=mem_per_rank,
                                 link=lk, plan=plan))
    out = {"mode": "size", "model": spec.describe() + _tp_note(spec, runner), "psi": spec.psi, "tp": tp,
           "settings": _settings(zcfg, precision, gdt, gas, tp, bucket), "global_batch": global_batch,
           "mem_per_rank": mem_per_rank, "runs": runs}
    if per:
        out["nodes"] = _across(runs, runner, per, zcfg, precision, gas, gdt, buckets, lk, intra_link,
                               nics_per_node, modes)
    return out


class _Resolved(NamedTuple):
    """What size() and dry_run() start from: the model, its own ZeroConfig (None for a
    preset or a count) and global batch, the ZeroConfig in use, and each setting as given
    or else the config's."""
    spec: models.ModelSpec
    model_zero: ZeroConfig | None
    global_batch: int | None
    zero: ZeroConfig
    precision: str
    grad_accum_dtype: str
    gas: int
    tp: int


def _resolve(model, seq_len, zero, mode, precision, grad_accum_dtype, gas, tp) -> _Resolved:
    """`mode` = (shard_group, hierarchical, secondary_partition), applied to the config."""
    spec, zcfg_cfg, global_batch = resolve_model(model, seq_len)
    zcfg = with_mode(zero or zcfg_cfg or ZeroConfig(precision="bf16"), *mode)
    return _Resolved(spec, zcfg_cfg, global_batch, zcfg, precision or zcfg.precision,
                     grad_accum_dtype or zcfg.grad_accum_dtype, gas or zcfg.gradient_accumulation_steps,
                     _resolve_tp(tp, zcfg, spec))


def dry_run(model, dps: Sequence[int] = (1, 3, 64, 1024, 4096), stages: Sequence[int] = STAGES, *,
            precision: str | None = None, grad_accum_dtype: str | None = None, gas: int | None = None,
            bucket: "int | str | None" = None, check_ranks: Sequence[int] | None = None, link=None,
            alpha=None, beta=None, seq_len: int = 0, zero: ZeroConfig | None = None,
            ranks_per_node: int | None = None, nodes: int | None = None, nics_per_node: int | None = None,
            intra_link="nvlink", shard_group=None, hierarchical=None, secondary_partition=None,
            modes: dict | None = None, tp: int | None = None) -> dict:
    """The engine's own partition layout at N virtual ranks (no MPI, no data, no
    parameter memory): per-rank bytes against the formula, imbalance, collectives. With
    ranks_per_node or nodes: also each run's mode and every other across nodes (as size()).
    tp (default: the config's zero.tensor_parallel_size, else 1): N is then the number
    of data-parallel ranks, and the layout is of one tp rank's share of the model."""
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    spec, _, _, zcfg, precision, gdt, gas, tp = _resolve(
        model, seq_len, zero, (shard_group, hierarchical, secondary_partition), precision, grad_accum_dtype, gas, tp)
    _check(dps, stages, tp, gas)
    memory.element_bytes(precision, gdt)
    for r in check_ranks or ():
        if not all(0 <= r < n for n in dps):
            raise ValueError(f"--check-ranks: rank {r} is outside some N of --dp {list(dps)}")
    # a link only when named: otherwise "auto" is the engine's own rule
    lk = resolve_link(link, alpha, beta) if bucket == "auto" and (link or alpha or beta) else None
    per = placement(dps, ranks_per_node, nodes, tp)
    runner = DryRun(spec, zcfg, tp)
    buckets = [_bucket_at(bucket, n, zcfg, precision, lk, s) for n in dps for s in stages]
    runs = [_dry_run(runner, n, s, precision, gdt, gas, tuple(check_ranks) if check_ranks else None, b)
            for (n, s), b in zip([(n, s) for n in dps for s in stages], buckets)]
    rss = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024
    out = {"mode": "dry_run", "model": spec.describe() + _tp_note(spec, runner), "psi": spec.psi, "tp": tp,
           "settings": _settings(zcfg, precision, gdt, gas, tp, bucket),
           "meta_seconds": runner.meta_seconds, "rss_growth_mib": rss,
           "seconds": time.perf_counter() - t0, "runs": runs}
    if per:
        out["nodes"] = _across(runs, runner, per, zcfg, precision, gas, gdt, buckets,
                               resolve_link(link, alpha, beta), intra_link, nics_per_node, modes)
    return out


def _resolve_tp(tp: int | None, zcfg: ZeroConfig, spec: models.ModelSpec) -> int:
    """tp as given, else the config's zero.tensor_parallel_size; a size the GPT cannot be
    split over is an error naming where it came from (the train command's own check)."""
    src, tp = ("--tp", tp) if tp is not None else ("zero.tensor_parallel_size", zcfg.tensor_parallel_size)
    problem = spec.gpt.tp_problem(tp) if spec.gpt is not None and tp > 1 else None
    if problem:
        raise ValueError(f"{src} {tp}: {problem}")
    return tp


def _tp_note(spec: models.ModelSpec, runner: DryRun) -> str:
    """What the layout is of, when tp > 1."""
    if runner.tp == 1:
        return ""
    local = sum(p.numel() for _, p in runner.trainable)
    if spec.gpt is None:
        return (f"\ntp = {runner.tp}: a bare count has no layers to split; each tp rank lays out a flat "
                f"vector of Ψ/tp = {local:,} elements.")
    return (f"\ntp = {runner.tp}: each tp rank lays out its share as the train command splits the model "
            f"(parallel/parallelize.py: heads, MLP and padded vocabulary split; LayerNorms, positions "
            f"and row-parallel biases replicated): {local:,} parameters.")


def parse_list(text: str, what: str) -> list[int]:
    """'1,4,16' -> [1, 4, 16] (also '4096', '1e3'); the error names the option."""
    out = []
    for tok in str(text).split(","):
        tok = tok.strip()
        try:
            v = float(tok)
        except ValueError:
            raise ValueError(f"{what}: {tok!r} is not a number (give a comma-separated list, e.g. 1,4,16)") from None
        if not math.isfinite(v) or v != int(v):
            raise ValueError(f"{what}: {tok!r} is not a whole number")
        out.append(int(v))
    return out
