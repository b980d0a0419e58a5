"""`python -m zerompi.prepare`: documents in, tokenized HDF5 shards out (docs/data.md).

    out/train/00000.h5, out/val/00000.h5, ...  one pair per unit of input (readers.py)
    out/prepare.json                          the manifest, written last

Each shard holds `tokens` (1-D, the smallest unsigned dtype that holds the vocabulary)
and `doc_offsets` (int64, n_docs + 1 offsets from 0 to n_tokens), with attributes naming
the tokenizer, its hash, the vocabulary size and the sha256 of the tokens.

Deterministic: a shard's bytes depend only on its unit of input and the settings (a
document goes to validation by a draw seeded by (seed, unit), in document order), never
on the number of workers or the order they finish in. Resumable: a shard is written to a
temporary name and renamed, so after a kill each shard is either whole or absent, and a
rerun skips the units whose shards exist with the same settings (their `plan` attribute).
Bounded memory: a worker holds one unit's documents and tokens at a time; the main
process holds none.
"""
from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import pathlib
import time

import numpy as np

from .readers import PrepareError, Tokenizer, Unit, documents, input_files, input_stamp, plan, token_dtype

FORMAT, VERSION = "zerompi-tokens", 1
_VAL_STREAM = 0x56414C  # "VAL": the split's draws, apart from other users of the seed
_TOK: Tokenizer | None = None  # the worker's tokenizer (set before the fork, or by _init)


def _init(spec: str) -> None:
    global _TOK
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the processes are the parallelism
    if _TOK is None or _TOK.spec != spec:
        _TOK = Tokenizer(spec)


def shard_name(out: pathlib.Path, split: str, index: int) -> pathlib.Path:
    return out / split / f"{index:05d}.h5"


def write_shard(path: pathlib.Path, tokens: np.ndarray, offsets: np.ndarray, attrs: dict) -> None:
    """One shard, atomically: written as path.tmp, then renamed."""
    import h5py

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with h5py.File(tmp, "w") as f:  # contiguous datasets: h5dump and numpy read them plainly
        f.create_dataset("tokens", data=tokens)
        f.create_dataset("doc_offsets", data=offsets)
        for k, v in sorted(attrs.items()):
            f.attrs[k] = v
    os.replace(tmp, path)


def _plan_key(unit: Unit, settings: dict) -> str:
    what = {"unit": unit.describe(), "size": input_stamp(unit.path, unit.kind), **settings}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:32]


def _done(out: pathlib.Path, unit: Unit, key: str) -> bool:
    import h5py

    try:
        for split in ("val", "train"):
            with h5py.File(shard_name(out, split, unit.index), "r") as f:
                if f.attrs.get("plan") != key:
                    return False
        return True
    except (OSError, KeyError):
        return False


def _tokenize(job) -> dict:
    """Worker: tokenize one unit into its train and val shards; their summaries."""
    unit, out, s, key = job
    tok = _TOK
    dtype = token_dtype(tok.vocab_size)
    eos = s["eos_id"]
    rng = np.random.default_rng([s["seed"], _VAL_STREAM, unit.index])
    parts: dict[str, list[np.ndarray]] = {"train": [], "val": []}
    for docs in documents(unit, s["field"], s["text_docs"]):
        draws = rng.random(len(docs))  # one per document, empty ones too: the split depends on the input only
        for ids, r in zip(tok.encode(docs), draws):
            if eos is not None:
                ids = np.append(ids, eos)
            if len(ids):
                parts["val" if r < s["val_fraction"] else "train"].append(ids.astype(dtype))
    summary = {"unit": unit.index, "source": unit.describe()}
    for split in ("val", "train"):  # train last: its presence marks the unit done
        docs = parts[split]
        tokens = np.concatenate(docs) if docs else np.empty(0, dtype)
        offsets = np.concatenate([[0], np.cumsum([len(d) for d in docs], dtype=np.int64)]).astype(np.int64)
        digest = hashlib.sha256(tokens.tobytes()).hexdigest()
        write_shard(shard_name(out, split, unit.index), tokens, offsets, {
            "format": FORMAT, "format_version": VERSION, "split": split, "source": unit.describe(),
            "tokenizer": tok.name, "tokenizer_sha256": tok.sha256, "vocab_size": tok.vocab_size,
            "eos_id": -1 if eos is None else int(eos), "n_tokens": len(tokens), "n_docs": len(docs),
            "tokens_sha256": digest, "plan": key})
        summary[split] = {"file": f"{split}/{unit.index:05d}.h5", "tokens": len(tokens), "docs": len(docs),
                          "tokens_sha256": digest}
        parts[split] = []
    return summary


def _summary_of(out: pathlib.Path, unit: Unit) -> dict:
    import h5py

    summary = {"unit": unit.index, "source": unit.describe()}
    for split in ("val", "train"):
        with h5py.File(shard_name(out, split, unit.index), "r") as f:
            summary[split] = {"file": f"{split}/{unit.index:05d}.h5", "tokens": int(f.attrs["n_tokens"]),
                              "docs": int(f.attrs["n_docs"]), "tokens_sha256": str(f.attrs["tokens_sha256"])}
    return summary


def prepare(inputs: list[str], out: str, tokenizer: str = "bytes", *, field: str = "text",
            text_docs: str = "file", val_fraction: float = 0.0, seed: int = 0, workers: int = 1,
            unit_mb: float = 64.0, eos: str = "auto", progress: bool | None = None) -> dict:
    """Tokenize `inputs` into shards under `out`; returns the manifest (also out/prepare.json)."""
    if text_docs not in ("file", "line", "paragraph"):
        raise PrepareError(f"--text_docs {text_docs}: must be file, line or paragraph")
    if not 0.0 <= val_fraction < 1.0:
        raise PrepareError(f"--val_fraction {val_fraction}: must be in [0, 1)")
    if workers < 1 or unit_mb <= 0:
        raise PrepareError("--workers must be >= 1 and --unit_mb > 0")
    global _TOK
    _TOK = tok = Tokenizer(tokenizer)  # checked here; the forked workers inherit it
    if eos == "auto":
        eos_id = tok.eos_id
    elif eos == "none":
        eos_id = None
    else:
        try:
            eos_id = int(eos)
        except ValueError:
            raise PrepareError(f"--eos {eos}: must be auto, none or a token id") from None
        if not 0 <= eos_id < tok.vocab_size:
            raise PrepareError(f"--eos {eos}: not an id of the {tok.vocab_size}-token vocabulary")
    settings = {"tokenizer": tok.name, "tokenizer_sha256": tok.sha256, "vocab_size": tok.vocab_size,
                "dtype": token_dtype(tok.vocab_size).name, "eos_id": eos_id, "field": field,
                "text_docs": text_docs, "val_fraction": val_fraction, "seed": seed,
                "unit_bytes": int(unit_mb * 2**20)}
    units = plan(input_files(inputs), settings["unit_bytes"], text_docs)
    comm = _mpi_world()
    rank, size = (comm.rank, comm.size) if comm is not None else (0, 1)
    outp = pathlib.Path(out)
    keys = {u.index: _plan_key(u, settings) for u in units}
    if rank == 0:
        outp.mkdir(parents=True, exist_ok=True)
        (outp / "prepare.json").unlink(missing_ok=True)  # complete again only once every shard is
        for split in ("train", "val"):  # a killed write, or shards of an earlier plan with more units
            d = outp / split
            for f in sorted(d.iterdir()) if d.is_dir() else []:
                if f.name.endswith(".tmp") or (f.suffix == ".h5" and f.stem.isdigit() and int(f.stem) >= len(units)):
                    f.unlink()
    if comm is not None:
        comm.barrier()
    # ranks take units round-robin; the shards are the same whoever writes them
    todo = [u for u in units if u.index % size == rank and not _done(outp, u, keys[u.index])]
    from tqdm import tqdm

    t0, new_tokens, error = time.perf_counter(), 0, None
    # progress None: a bar when stderr is a terminal (tqdm's disable=None); rank 0's units only
    bar = tqdm(total=len(todo), unit="shard", desc="prepare", disable=rank > 0 or (None if progress is None else
                                                                                   not progress))
    jobs = [(u, outp, settings, keys[u.index]) for u in todo]
    pool = None
    try:
        if workers == 1 or len(todo) <= 1:
            results = map(_tokenize, jobs)
        else:
            pool = mp.get_context("fork").Pool(min(workers, len(todo)), initializer=_init, initargs=(tokenizer,))
            results = pool.imap_unordered(_tokenize, jobs)
        for r in results:
            new_tokens += r["train"]["tokens"] + r["val"]["tokens"]
            bar.update(1)
            bar.set_postfix_str(f"{new_tokens / max(1e-9, time.perf_counter() - t0):,.0f} tokens/s")
    except PrepareError as e:
        if comm is None:
            raise
        error = str(e)
    finally:
        bar.close()
        if pool is not None:
            pool.terminate()
    if comm is not None:  # every rank's outcome, so that all stop together on a bad input
        errors = [e for e in comm.allgather(error) if e]
        new_tokens = comm.allreduce(new_tokens)
        if errors:
            raise PrepareError(errors[0])
    done_before = len(units) - comm.allreduce(len(todo)) if comm is not None else len(units) - len(todo)
    elapsed = time.perf_counter() - t0
    manifest = None
    if rank == 0:  # from the shards themselves: whichever rank or run wrote them
        ordered = [_summary_of(outp, u) for u in units]
        manifest = {"format": FORMAT, "format_version": VERSION, **settings, "inputs": list(inputs),
                    "shards": {s: [o[s] for o in ordered] for s in ("train", "val")},
                    "tokens": {s: sum(o[s]["tokens"] for o in ordered) for s in ("train", "val")},
                    "docs": {s: sum(o[s]["docs"] for o in ordered) for s in ("train", "val")}}
    if rank == 0:
        tmp = outp / "prepare.json.tmp"
        tmp.write_text(json.dumps(manifest, indent=1) + "\n")
        os.replace(tmp, outp / "prepare.json")
    if comm is not None:
        manifest = comm.bcast(manifest)  # the manifest exists when any rank returns
    return {"manifest": manifest, "units": len(units), "done_before": done_before, "new_tokens": new_tokens,
            "seconds": elapsed, "rank": rank, "ranks": size}


def _mpi_world():
    """COMM_WORLD when launched as several MPI ranks (mpiexec, srun), else None: MPI is not
    started for a plain run."""
    launched = any(int(os.environ.get(k, "1") or 1) > 1 for k in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE",
                                                                 "PMIX_SIZE", "MPI_LOCALNRANKS"))
    if not launched:
        return None
    from mpi4py import MPI

    return MPI.COMM_WORLD if MPI.COMM_WORLD.size > 1 else None
