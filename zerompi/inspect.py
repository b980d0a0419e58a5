"""Look into a zerompi checkpoint without MPI or torch.

    python -m zerompi.inspect CKPT                 # verify (sizes, checksums, coverage, structure),
                                                   # then summary, config, tensor tree, owners
    python -m zerompi.inspect CKPT --no-verify     # skip the checksum pass (big checkpoints)
    python -m zerompi.inspect CKPT --tensor emb.weight [--kind exp_avg]   # statistics

CKPT is a checkpoint directory (DIR/TAG) or the directory above it (then DIR/latest).
Exit status: 0 fine, 1 verification or read failure (message on stderr), 2 usage.
Statistics are read piece by piece from the rank files (not through index.h5, whose
virtual datasets would show a missing shard as fill values).
"""
from __future__ import annotations

import argparse
import json
import math
import sys

import numpy as np

from .checkpoint import naming
from .checkpoint import verify as ver
from .checkpoint.directory import resolve
from .checkpoint.errors import CheckpointError
from .checkpoint.reader import PieceReader

_CHUNK = 1 << 22  # elements read at a time for statistics


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _numel(shape) -> int:
    return int(np.prod(shape)) if shape else 1


def owners(pieces: list, limit: int = 3) -> str:
    """'r0[0:144) r1[144:481)', or a count per rank when ranges are many."""
    by_rank: dict[int, list] = {}
    for r, lo, hi, _ in pieces:
        ranges = by_rank.setdefault(r, [])
        if ranges and ranges[-1][1] == lo:
            ranges[-1][1] = hi  # adjacent pieces of one rank read as one range
        else:
            ranges.append([lo, hi])
    parts = []
    for r, ranges in sorted(by_rank.items()):
        if len(ranges) <= limit:
            parts.append(" ".join(f"r{r}[{lo}:{hi})" for lo, hi in ranges))
        else:
            parts.append(f"r{r}:{len(ranges)} ranges/{sum(h - l for l, h in ranges)} el")
    return " ".join(parts)


def summary(ckpt: str, m: dict, out=sys.stdout) -> None:
    p = lambda *a: print(*a, file=out)  # noqa: E731
    c = m["counters"]
    p(f"checkpoint {ckpt}")
    p(f"  tag {m['tag']}  step {c['global_steps']} (micro-steps {c['micro_steps']}, "
      f"skipped {c.get('skipped_steps', 0)})  created {m.get('created', '?')}")
    p(f"  saved by zerompi {m['zerompi_version']}, torch {m['torch_version']}, "
      f"h5py {m['h5py_version']} (HDF5 {m['hdf5_version']})")
    p(f"  world size {m['world_size']}  stage {m['stage']}  precision {m['precision']}  "
      f"working params {m['param_dtype']}  states {m['state_dtype']}  loss scale {m['scaler'].get('scale')}")
    p(f"  client_state {json.dumps(m['client_state'])}")
    files = ver.file_list(m)
    p(f"files ({len(files)}, {human(sum(i['size'] for _, i in files))}):")
    for name, info in files:
        extra = f"  {info['elements']} values per kind" if "elements" in info else ""
        p(f"  {name:<16}{info['size']:>14} B  {human(info['size']):>10}  {(info.get('digest') or 'sha256:' + info['sha256'])[:24]}…{extra}")
    p("config:")
    for k, v in m["config"].items():
        p(f"  {k} = {json.dumps(v)}")
    kinds = " ".join(f"/{k}" for k in m["kinds"])
    total = sum(_numel(t["shape"]) for t in m["tensors"].values())
    p(f"tensors: {len(m['tensors'])} parameters, {total} elements, in index.h5 under {kinds} "
      f"(float32, {human(4 * total)} each)" + (f" and /{m['lowp_kind']} ({m['param_dtype']})" if m.get("lowp_kind") else ""))
    width = max([len(n) for n in m["tensors"]] + [len(n) for n in m.get("module_tensors", {})] + [4])
    for name, t in m["tensors"].items():
        n = _numel(t["shape"])
        p(f"  {name:<{width}}  {str(t['shape']):<14} {'float32':<9}{n:>12}  {human(4 * n):>10}  {owners(t['pieces'])}")
    if m.get("module_tensors"):
        p(f"module state (frozen parameters, buffers) under /module, held by {naming.rank_file(0)}:")
        for name, t in m["module_tensors"].items():
            n = _numel(t["shape"])
            p(f"  {name:<{width}}  {str(t['shape']):<14} {t['torch_dtype']:<9}{n:>12}  {t['role']}")
    if m.get("aliases"):
        p("tied (stored once): " + ", ".join(f"{a} -> {b}" for a, b in m["aliases"].items()))


def stats(reader: PieceReader, m: dict, name: str, kind: str) -> dict:
    """min/max/mean/std (population)/L2 norm in float64, streamed in chunks."""
    if name in m["tensors"]:
        numel = _numel(m["tensors"][name]["shape"])
        chunks = ((lo, min(numel, lo + _CHUNK)) for lo in range(0, numel, _CHUNK))
        read = lambda lo, hi: reader.read(kind, name, lo, hi)  # noqa: E731
    elif name in m.get("module_tensors", {}):
        arr = np.asarray(reader.module_tensor(name)).ravel()
        numel, chunks = arr.size, [(0, arr.size)]
        read = lambda lo, hi: arr[lo:hi]  # noqa: E731
    else:
        known = list(m["tensors"]) + list(m.get("module_tensors", {}))
        raise CheckpointError(f"no tensor {name!r} in the checkpoint (tensors: {', '.join(known[:10])}"
                              + (" ..." if len(known) > 10 else "") + ")")
    n, s, ss, lo_v, hi_v = 0, 0.0, 0.0, math.inf, -math.inf
    for lo, hi in chunks:
        x = read(lo, hi).astype(np.float64)
        if x.size:
            n += x.size
            s += float(x.sum())
            ss += float(np.dot(x, x))
            lo_v, hi_v = min(lo_v, float(x.min())), max(hi_v, float(x.max()))
    mean = s / n if n else float("nan")
    var = max(ss / n - mean * mean, 0.0) if n else float("nan")
    return {"numel": numel, "min": lo_v, "max": hi_v, "mean": mean, "std": math.sqrt(var), "norm": math.sqrt(ss)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m zerompi.inspect", description=__doc__.split("\n")[0])
    ap.add_argument("ckpt", help="checkpoint directory DIR/TAG, or DIR (uses DIR/latest)")
    ap.add_argument("--tag", help="tag inside DIR (default: DIR/latest)")
    ap.add_argument("--verify", action="store_true", default=True,
                    help="check sizes, checksums, coverage and structure (the default)")
    ap.add_argument("--no-verify", dest="verify", action="store_false",
                    help="skip verification: statistics of a damaged checkpoint may then show zeros")
    ap.add_argument("--tensor", action="append", default=[], metavar="NAME", help="print statistics (repeatable)")
    ap.add_argument("--kind", default=None, help="state kind for --tensor (default: all)")
    a = ap.parse_args(argv)
    try:
        ckpt = resolve(a.ckpt, a.tag)
        if ckpt is None:
            raise CheckpointError(f"{a.ckpt}: no checkpoint here")
        m = ver.verify_checkpoint(ckpt) if a.verify else ver.read_manifest(ckpt)
        summary(ckpt, m)
        if a.verify:
            print(f"verify: OK ({len(ver.file_list(m))} files, sizes and checksums match, every tensor complete)")
        else:
            problems = ver.check_files(ckpt, m, hash_share=None) + ver.check_coverage(m)
            for msg in problems:
                print(f"WARNING: {msg}", file=sys.stderr)
            print("verify: skipped (--no-verify): checksums not checked", file=sys.stderr)
            if problems and a.tensor:  # statistics of missing pieces would be zeros
                raise CheckpointError("not printing --tensor statistics of a damaged checkpoint")
        if a.tensor:
            with PieceReader(ckpt, m) as reader:
                for name in a.tensor:
                    is_module = name in m.get("module_tensors", {})
                    kinds = ["module"] if is_module else ([a.kind] if a.kind else list(m["kinds"]))
                    for kind in kinds:
                        st = stats(reader, m, name, kind)
                        print(f"{kind}/{name}: numel {st['numel']}  min {st['min']:.9g}  max {st['max']:.9g}  "
                              f"mean {st['mean']:.9g}  std {st['std']:.9g}  norm {st['norm']:.9g}")
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # e.g. an HDF5 file that is not HDF5 at all
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
