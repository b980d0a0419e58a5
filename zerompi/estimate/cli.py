"""`python -m zerompi.estimate`: size a ZeRO run before launching it (docs/scaling.md).

  --table1                                   the paper's Table 1 from our formulas
  --params 7.5e9 [--dp 1,4,16] [--tp 2]      model states per rank, every stage
  --model gpt-7.5b | --config run.toml       a concrete model: memory (states, buffers,
        [--mem-per-rank 80GiB] [--link ndr-ib] activations, largest micro-batch) and the
                                             collectives of one step with predicted time
  ... --dry-run --dp 4096                    the engine's real layout at N virtual ranks
  ... --ranks-per-node 8 (or --nodes K)      + what the run's mode (its zero.shard_group,
                                             comm.hierarchical, stage3.secondary_partition)
                                             moves inside and across nodes and its time,
                                             next to every other mode (docs/scaling.md)
  --json                                     the same data for machines

Bad input prints one line ("zerompi.estimate: error: ...") and exits with status 2.
"""
from __future__ import annotations

import argparse
import json
import sys

from ..config import ConfigError
from ..comm import cost_model
from . import api, memory, report

EXAMPLES = """examples:
  python -m zerompi.estimate --table1
  python -m zerompi.estimate --params 7.5e9 --dp 1,4,16,64,256,1024
  python -m zerompi.estimate --config configs/gpt2-124m-gpu.toml --dp 8,64,512 --mem-per-rank 80GiB
  python -m zerompi.estimate --model gpt-7.5b --dp 1024 --stage 3 --link ndr-ib
  python -m zerompi.estimate --model small --dp 4 --nodes 2 --nics-per-node 1 --precision fp32 --alpha 5e-5 --beta 8e-8
  python -m zerompi.estimate --model gpt-7.5b --dry-run --dp 4096
  python -m zerompi.estimate --model gpt-7.5b --dp 1024 --stage 3 --ranks-per-node 8 --link ndr-ib
model presets: """


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, no usage dump
        raise ValueError(message)


def parser() -> argparse.ArgumentParser:
    from .models import ALL_SHAPES

    p = _Parser(prog="python -m zerompi.estimate", description=__doc__.split("\n\n")[0],
                epilog=EXAMPLES + ", ".join(ALL_SHAPES), formatter_class=argparse.RawDescriptionHelpFormatter)
    what = p.add_mutually_exclusive_group()
    what.add_argument("--table1", action="store_true", help="print the ZeRO paper's Table 1 from our formulas")
    what.add_argument("--params", type=float, help="parameter count Psi (e.g. 7.5e9): formulas only")
    what.add_argument("--model", help="a GPT preset (see below)")
    what.add_argument("--config", help="a zerompi.train TOML/JSON config (model, global_batch, zero.*)")
    p.add_argument("--dry-run", action="store_true",
                   help="build the engine's partition layout at each N (no MPI, no memory)")
    p.add_argument("--dp", default=None, help="data-parallel ranks N, comma-separated "
                   "(default 1,4,16,64,256,1024; dry run 1,3,64,1024,4096; on nodes 1024)")
    p.add_argument("--tp", type=int, default=None,
                   help="tensor-parallel degree (default: the config's zero.tensor_parallel_size, else 1): "
                        "each tp rank's share of the model, partitioned over --dp data-parallel ranks")
    p.add_argument("--stage", default=None, help="ZeRO stages, comma-separated (default: all; "
                   "with --config its zero.stage)")
    p.add_argument("--precision", choices=memory.PRECISIONS, default=None,
                   help="default bf16 (the config's with --config)")
    p.add_argument("--grad-accum-dtype", choices=("param", "fp32"), default=None)
    p.add_argument("--gas", type=int, default=None, help="gradient accumulation steps")
    p.add_argument("--bucket-size", default=None,
                   help="elements per bucket (e.g. 4M = 4,194,304) or 'auto' (the engine's default rule); "
                   "default: the config's zero.bucket_size")
    p.add_argument("--micro-batch", type=int, default=None,
                   help="sequences per rank and micro-step (default: global_batch / (N x GAS), else 1)")
    p.add_argument("--seq", type=int, default=0, help="tokens per sequence (default: the config's/model's)")
    p.add_argument("--mem-per-rank", default=None, help="memory per rank, e.g. 80GiB, 40GB: "
                   "find the largest micro-batch that fits")
    p.add_argument("--link", choices=sorted(cost_model.PRESETS), default=None,
                   help=f"link preset for the communication time (default {cost_model.DEFAULT_AUTO_LINK})")
    p.add_argument("--alpha", type=float, default=None, help="latency per message step, seconds")
    p.add_argument("--beta", type=float, default=None, help="seconds per byte (1 / bandwidth)")
    p.add_argument("--check-ranks", default=None, help="dry run: ranks whose real elements are "
                   "recounted from layout.pieces (default: 0, the most padded rank, N-1)")
    p.add_argument("--ranks-per-node", type=int, default=None, metavar="P",
                   help="the ranks sit on nodes of P, in blocks: add what the run's mode moves inside and "
                   "across nodes per step and its time, and every "
                   "hierarchy mode (hybrid sharding, two-level collectives, stage-3 secondary partition) compared; "
                   "--link/--alpha/--beta is then the link between nodes")
    p.add_argument("--nodes", type=int, default=None, metavar="K",
                   help="the same as --ranks-per-node N x tp / K: the N x tp ranks on K nodes")
    p.add_argument("--nics-per-node", type=int, default=None, metavar="Q",
                   help="with nodes: links between nodes per node, each the --link (default one per rank; "
                   "1: one link shared by the node's ranks)")
    p.add_argument("--intra-link", choices=sorted(cost_model.PRESETS), default="nvlink",
                   help="with nodes: the link inside a node (default nvlink)")
    p.add_argument("--shard-group", default=None, help="the run's zero.shard_group (world | node | K; "
                   "default: the config's)")
    p.add_argument("--hierarchical", choices=("auto", "on", "off"), default=None,
                   help="the run's zero.comm.hierarchical (default: the config's)")
    p.add_argument("--secondary-partition", default=None, help="the run's zero.stage3.secondary_partition "
                   "(off | node | K; default: the config's)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    return p


def run(argv: list[str]) -> tuple[dict | list, str]:
    a = parser().parse_args(argv)
    if a.dry_run and a.table1:
        raise ValueError("--dry-run needs a model (--model, --config or --params), not --table1")
    if a.table1:
        rows = api.table1()
        return rows, report.render_table1(rows)
    if a.params is None and a.model is None and a.config is None:
        raise ValueError("say what to estimate: --table1, --params N, --model PRESET or --config FILE "
                         "(--help for more)")
    stages = api.parse_list(a.stage, "--stage") if a.stage is not None else None
    bucket = None if a.bucket_size is None else (
        "auto" if a.bucket_size == "auto" else memory.parse_count(a.bucket_size))
    mem = None if a.mem_per_rank is None else memory.parse_bytes(a.mem_per_rank)
    if a.seq < 0:
        raise ValueError(f"--seq must be >= 1 (got {a.seq})")
    if a.config is not None and not a.config.endswith((".toml", ".json")):
        raise ValueError(f"--config {a.config!r}: expected a .toml or .json file")
    model = a.config if a.config is not None else a.model
    if a.params is not None:
        if a.params != a.params or a.params < 1:
            raise ValueError(f"--params must be >= 1 (got {a.params})")
        model = api.models.from_params(a.params, a.seq)
    nodes = {"ranks_per_node": a.ranks_per_node, "nodes": a.nodes, "nics_per_node": a.nics_per_node,
             "intra_link": a.intra_link, "shard_group": _mode_value(a.shard_group),
             "hierarchical": a.hierarchical, "secondary_partition": _mode_value(a.secondary_partition)}
    placed = a.ranks_per_node is not None or a.nodes is not None
    if a.nics_per_node is not None and not placed:
        raise ValueError("--nics-per-node goes with --ranks-per-node or --nodes")
    moded = any(v is not None for v in (a.shard_group, a.hierarchical, a.secondary_partition))
    if a.dry_run:
        dps = api.parse_list(a.dp or ("1024" if placed else "1,3,64,1024,4096"), "--dp")
        checks = api.parse_list(a.check_ranks, "--check-ranks") if a.check_ranks else None
        res = api.dry_run(model, dps, stages or api.STAGES, precision=a.precision,
                          grad_accum_dtype=a.grad_accum_dtype, gas=a.gas, bucket=bucket, check_ranks=checks,
                          link=a.link, alpha=a.alpha, beta=a.beta, seq_len=a.seq, tp=a.tp, **nodes)
        return res, report.render_dry_run(res)
    dps = api.parse_list(a.dp or ("1024" if placed else ",".join(map(str, memory.TABLE1_DP))), "--dp")
    if a.params is not None and mem is None and a.link is None and a.alpha is None and a.beta is None \
            and not placed and not moded:
        res = api.formulas(a.params, dps, stages or api.STAGES, a.precision or "bf16",
                           a.grad_accum_dtype or "param", 1 if a.tp is None else a.tp)
        return res, report.render_formulas(res)
    res = api.size(model, dps, stages, precision=a.precision, grad_accum_dtype=a.grad_accum_dtype, gas=a.gas,
                   tp=a.tp, bucket=bucket, micro_batch=a.micro_batch, seq_len=a.seq, mem_per_rank=mem,
                   link=a.link, alpha=a.alpha, beta=a.beta, **nodes)
    return res, report.render_sizing(res)


def _mode_value(v: str | None):
    return int(v) if v is not None and v.isdigit() else v


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        data, text = run(argv)
    except (ValueError, ConfigError, OSError) as e:  # bad input: one line, no traceback
        print(f"zerompi.estimate: error: {e}", file=sys.stderr)
        return 2
    if "--json" in argv:
        print(json.dumps(data, indent=1, default=float))
    else:
        print(text)
    return 0
