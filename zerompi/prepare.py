"""python -m zerompi.prepare INPUT... --out DIR [--tokenizer PATH|bytes] [options]

Tokenize text files, JSONL (--field), Parquet (--field) or a local Hugging Face datasets
folder into HDF5 token shards the trainer reads (`data = "DIR"`): DIR/train/*.h5,
DIR/val/*.h5 and DIR/prepare.json. Parallel over --workers processes, resumable (rerun
the same command after a kill: finished shards are skipped), deterministic (the same
input and settings give the same bytes with any number of workers). docs/data.md.

Under mpiexec or srun (several MPI ranks) the ranks share the units, each with its own
--workers processes; the shards are the same bytes as from one process.

Exit codes: 0 done; 2 bad input or settings (one line on stderr)."""
from __future__ import annotations

import argparse
import os
import sys

PROG = "zerompi.prepare"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m {PROG}", description=__doc__.split("\n\n")[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("inputs", nargs="+", metavar="INPUT",
                   help="files (.txt/.md, .jsonl/.json, .parquet), folders of them, or a datasets folder")
    p.add_argument("--out", required=True, help="output folder (train/, val/, prepare.json)")
    p.add_argument("--tokenizer", default="bytes",
                   help="a tokenizer.json, a Hugging Face tokenizer folder, or bytes (UTF-8 bytes, vocab 256; "
                        "the default)")
    p.add_argument("--field", default="text", help="the text's JSONL field / Parquet or datasets column (text)")
    p.add_argument("--text_docs", default="file", choices=("file", "line", "paragraph"),
                   help="what one document is in a text file (file: the whole file, cut every --unit_mb)")
    p.add_argument("--val_fraction", type=float, default=0.0,
                   help="fraction of the documents (drawn by --seed) written to val/ (0)")
    p.add_argument("--seed", type=int, default=0, help="seed of the train/validation draw (0)")
    p.add_argument("--workers", type=int, default=max(1, (len(os.sched_getaffinity(0))
                                                         if hasattr(os, "sched_getaffinity") else 1)),
                   help="tokenizing processes (default: the usable CPUs)")
    p.add_argument("--unit_mb", type=float, default=64.0,
                   help="input MB per shard: bounds each worker's memory (64)")
    p.add_argument("--eos", default="auto",
                   help="token appended to each document: auto (the tokenizer's end-of-text token, if "
                        "it has one), none, or an id")
    p.add_argument("--progress", choices=("auto", "bar", "none"), default="auto",
                   help="auto: a bar when stderr is a terminal")
    return p


def _launched_rank() -> int:
    """This process's rank as the MPI launcher says (0 outside one), without starting MPI."""
    for k in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"):
        if os.environ.get(k, "").isdigit():
            return int(os.environ[k])
    return 0


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    from .data.readers import PrepareError
    from .data.prepare import prepare

    try:
        r = prepare(args.inputs, args.out, args.tokenizer, field=args.field, text_docs=args.text_docs,
                    val_fraction=args.val_fraction, seed=args.seed, workers=args.workers, unit_mb=args.unit_mb,
                    eos=args.eos, progress={"auto": None, "bar": True, "none": False}[args.progress])
    except PrepareError as e:
        if _launched_rank() == 0:  # every rank has the same error: one line
            print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    if r["rank"]:
        return 0
    m = r["manifest"]
    rate = r["new_tokens"] / r["seconds"] if r["seconds"] > 0 else 0.0
    who = f" by {r['ranks']} ranks x {args.workers} workers" if r["ranks"] > 1 else ""
    print(f"{PROG}: {m['tokens']['train']:,} train / {m['tokens']['val']:,} val tokens, "
          f"{m['docs']['train'] + m['docs']['val']:,} documents in {r['units']} shard pairs "
          f"({r['done_before']} done before) -> {args.out} (tokenizer {m['tokenizer']}, vocab {m['vocab_size']}, "
          f"{m['dtype']}); {r['new_tokens']:,} tokens{who} in {r['seconds']:.1f} s = {rate:,.0f} tokens/s; "
          f"train with --data {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
