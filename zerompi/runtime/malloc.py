"""glibc heap helpers: the optional pinned mmap threshold, returning freed heap to the
OS, and stage 3's periodic trimming on host placements."""
from __future__ import annotations

import os

MMAP_THRESHOLD = 128 << 10
_mmap_fixed = False


def _libc():
    import ctypes
    import ctypes.util

    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")


def fix_mmap_threshold() -> None:
    """With ZEROMPI_MALLOC=return (and MALLOC_MMAP_THRESHOLD_ unset), pin glibc's mmap
    threshold at 128 KiB, once per process: a memory-for-time trade, off by default.

    glibc raises its threshold to the size of every large block it frees (up to 32 MiB),
    so after the first freed activation or gradient, blocks of that size come from the
    heap, where short-lived activations and gradients interleave and freed memory cannot
    go back to the OS. Pinned, they are mmapped and returned at once, but every fresh page
    then costs a fault: less memory, slower steps (docs/performance.md, "Stage-3 memory")."""
    global _mmap_fixed
    if _mmap_fixed or "MALLOC_MMAP_THRESHOLD_" in os.environ or os.environ.get("ZEROMPI_MALLOC") != "return":
        return
    _mmap_fixed = True
    try:
        _libc().mallopt(-3, MMAP_THRESHOLD)  # M_MMAP_THRESHOLD; also stops its dynamic growth
    except (OSError, AttributeError):
        pass


def release_free_memory() -> None:
    """Return freed heap pages to the OS (glibc malloc_trim; a no-op elsewhere).

    After construction and set-up many large temporaries (full parameters before
    partitioning, fp32 staging copies) are freed while small long-lived pieces sit above
    them in the heap; glibc's rising mmap threshold keeps that memory in the process.
    Measured: a 100M-parameter model under Init at N = 4 kept ~1.2 GB per rank instead
    of ~0.7 GB until trimmed."""
    try:
        _libc().malloc_trim(0)
    except (OSError, AttributeError):
        pass


class HeapTrimmer:
    """Gives freed heap memory back to the OS once every `every` bytes of released
    transients (glibc malloc_trim; host placements only).

    Why: in backward every stage-3 unit leaves gradients, recomputed activations and
    MPI temporaries of its size in the heap (glibc's dynamic mmap threshold puts blocks
    up to 32 MiB there); freed, they stay resident until reused, so the heap's high-water
    mark, not the live bytes, sets peak RSS. Trimming as units finish keeps only what the
    next unit touches. Measured (135M GPT, stage 3, N = 4, fp32, ZeRO-R checkpoints, "vm",
    benchmarks/investigations/results/stage3_rss_trim.json): peak RSS per rank 1056-1123 -> 1051-1063 MiB;
    cost per step ~0.1 s in malloc_trim plus ~90k page faults on reuse (~2-3% of a 10 s
    step). A GPU run's transients live in torch's caching allocator: no-op there."""

    EVERY = 32 << 20

    def __init__(self, placement, every: int | None = None):  # a device.Placement
        self.on = placement.device.type == "cpu"
        self.every, self.pending = every or self.EVERY, 0

    def released(self, nbytes: int) -> None:
        if not self.on:
            return
        self.pending += nbytes
        if self.pending >= self.every:
            self.pending = 0
            release_free_memory()
