"""compare_commits.py's two sides: the per-rank worker entry that imports zerompi from one
checkout (and proves it did), and what identifies a side (git commit, changed files, a
checksum of its zerompi code).

    mpiexec -n N python -m mpi4py benchmarks/compare_sides.py --worker-root ROOT \
        --worker-dir DIR -- BENCH_DP_WORKER_ARGS...      (compare_commits.py starts it)

This module imports no sibling at its top: with `--worker each` the ranks must import
bench_dp and harness (bench_env in older checkouts) from the other side's DIR, not this one's."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

# Shapes that are not zerompi.models.gpt presets, as GPTConfig keyword arguments. They are
# added to PRESETS inside this script's processes only (zerompi itself is not touched).
# "gpt-135m": byte-level, GPT-2-small width (768, 12 heads) and 19 blocks: 135,654,144 params.
# "gpt-17m": gpt-20m's depth (6) at width 480 (8 heads): 16,872,960 params.
EXTRA_SHAPES = {
    "gpt-135m": dict(vocab_size=256, block_size=1024, n_layer=19, n_head=12, n_embd=768),
    "gpt-17m": dict(vocab_size=256, block_size=256, n_layer=6, n_head=8, n_embd=480),
}
# Per-rank micro-batch (sequences, tokens each) for the extra shapes: like gpt-200m / gpt-20m.
EXTRA_BATCH = {"gpt-135m": (1, 256), "gpt-17m": (4, 256)}
WORKER_FILES = ("bench_dp.py", "dp_systems.py", "dp_driver.py", "harness.py", "bench_env.py")


def worker_main(root: str, worker_dir: str, argv: list[str]) -> None:
    """Runs on every rank under mpiexec: import zerompi from `root`, then bench_dp's worker."""
    root = os.path.realpath(root)
    sys.path.insert(0, root)
    import zerompi  # before harness, which puts its own repository first on sys.path

    got = os.path.realpath(zerompi.__file__)
    if not got.startswith(root + os.sep):
        raise SystemExit(f"[compare] zerompi imported from {got}, expected under {root}")
    sys.path.insert(0, worker_dir)
    import bench_dp  # noqa: E402  (also imports harness, dp_systems, dp_driver)
    shared = sys.modules.get("harness") or sys.modules["bench_env"]  # bench_env: older checkouts

    bench_root = str(shared.ROOT)
    if os.path.realpath(bench_root) != root:  # it inserted the other checkout: drop it
        sys.path[:] = [p for p in sys.path if p != bench_root]
    from zerompi.models.gpt import PRESETS, GPTConfig

    for name, kw in EXTRA_SHAPES.items():  # always ours: both sides must build the same shape
        PRESETS[name] = GPTConfig(**kw)
    from mpi4py import MPI

    rank = MPI.COMM_WORLD.Get_rank()
    if rank == 0:
        print(f"[compare] zerompi from {zerompi.__file__} (worker {worker_dir}/bench_dp.py)",
              flush=True)
    bench_dp.main(argv)
    # every zerompi module any code path loaded must come from the same checkout
    files = sorted({os.path.realpath(f) for n, m in list(sys.modules.items())
                    if (n == "zerompi" or n.startswith("zerompi."))
                    and (f := getattr(m, "__file__", None))})
    foreign = [f for f in files if not f.startswith(root + os.sep)]
    foreign = MPI.COMM_WORLD.allreduce(foreign)  # every rank's
    if rank == 0:
        out = argv[argv.index("--out") + 1]
        res = json.loads(Path(out).read_text())
        res["zerompi_file"] = os.path.realpath(zerompi.__file__)
        res["zerompi_version"] = getattr(zerompi, "__version__", None)
        res["zerompi_modules_loaded"] = len(files)
        res["zerompi_foreign_modules"] = sorted(set(foreign))
        Path(out).write_text(json.dumps(res, indent=1))
    if foreign:
        raise SystemExit(f"[compare] zerompi modules from outside {root}: {sorted(set(foreign))}")


def _git(root: str, *args: str) -> str | None:
    try:  # read-only plumbing; --no-optional-locks: never refresh the index
        p = subprocess.run(["git", "--no-optional-locks", "-C", root, *args],
                           capture_output=True, text=True, timeout=60)
        return p.stdout.rstrip() if p.returncode == 0 else None  # porcelain lines start with " "
    except (OSError, subprocess.TimeoutExpired):
        return None


def _tree_sha256(directory: Path, pattern: str = "*.py") -> str | None:
    if not directory.is_dir():
        return None
    h = hashlib.sha256()
    for f in sorted(directory.rglob(pattern)):
        if "__pycache__" in f.parts:
            continue
        h.update(str(f.relative_to(directory)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def side_info(root: str, worker_dir: Path) -> dict:
    status = _git(root, "status", "--porcelain")
    return {
        "path": root,
        "git_commit": _git(root, "rev-parse", "HEAD"),
        "git_subject": _git(root, "log", "-1", "--format=%s"),
        "git_dirty_files": status.splitlines() if status else [],
        # identifies uncommitted code too: every zerompi/**/*.py, path and content
        "zerompi_py_sha256": _tree_sha256(Path(root) / "zerompi"),
        "worker_dir": str(worker_dir),
        "worker_files_sha256": {f: hashlib.sha256((worker_dir / f).read_bytes()).hexdigest()
                                for f in WORKER_FILES if (worker_dir / f).exists()},
    }


if __name__ == "__main__":  # on every rank, started by compare_commits.py
    args = sys.argv[1:]
    sep = args.index("--")
    opts = dict(zip(args[:sep:2], args[1:sep:2]))
    worker_main(opts["--worker-root"], opts.get("--worker-dir", str(Path(__file__).resolve().parent)),
                args[sep + 1:])
