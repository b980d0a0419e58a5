"""MPI start-up, whole-job abort on any rank's exception, agreeing on errors, seeding.

Without an abort, an exception on one rank leaves the others blocked in a collective
forever (and Python's exit blocks in MPI_Finalize). `install_abort_hook` makes any
uncaught exception print that rank's traceback and call MPI_Abort, so `mpiexec`/`srun`
end the whole job within a second, also when the user did not use `python -m mpi4py`.
"""
from __future__ import annotations

import faulthandler

import os
import random
import sys
import threading
import time
import traceback
from typing import Any

import numpy as np

_hook_installed = False


def mpi():
    """The mpi4py.MPI module (initialises MPI on first use)."""
    from mpi4py import MPI

    return MPI


def _write_all(fd: int, data: bytes) -> None:
    """os.write to the fd itself: sys.stderr may be replaced, closed or buffered."""
    while data:
        try:
            data = data[os.write(fd, data):]
        except InterruptedError:
            continue
        except OSError:
            return


def _drain(fd: int, seconds: float) -> None:
    """Wait (at most `seconds`) until the reader at the other end of `fd` has taken what
    we wrote: mpiexec's proxy reads each rank's stderr pipe, and MPI_Abort makes the
    launcher kill every process, possibly before that read. A sleep alone lost the
    traceback in ~1-2% of aborted 3-rank MPICH jobs. Pipes report unread bytes with
    FIONREAD, sockets unsent ones with TIOCOUTQ (= SIOCOUTQ); files are fsynced."""
    import fcntl
    import stat
    import struct
    import termios

    try:
        mode = os.fstat(fd).st_mode
    except OSError:
        return
    if stat.S_ISREG(mode):
        try:
            os.fsync(fd)
        except OSError:
            pass
        return
    req = termios.FIONREAD if stat.S_ISFIFO(mode) else termios.TIOCOUTQ if stat.S_ISSOCK(mode) else None
    deadline = time.monotonic() + seconds
    while req is not None and time.monotonic() < deadline:
        try:
            left = struct.unpack("i", fcntl.ioctl(fd, req, b"\0" * 4))[0]
        except OSError:
            return
        if left <= 0:
            return
        time.sleep(0.005)

def _from_destructor(tb) -> bool:
    """Cython reports an error inside a destructor (__dealloc__) through sys.excepthook
    (PyErr_PrintEx), with that destructor as the outermost frame: such an error is
    "ignored" by Python's rules and must not end the job. Seen: h5py releasing a file id
    after a write failed with ENOSPC, at whatever moment the garbage collector ran."""
    return tb is not None and tb.tb_frame.f_code.co_name.rsplit(".", 1)[-1] in ("__dealloc__", "_dealloc")


def _abort_excepthook(exc_type, exc, tb) -> None:
    if _from_destructor(tb):
        sys.stderr.write(f"zerompi: ignored an error in a destructor: {exc_type.__name__}: {exc}\n")
        return
    MPI = sys.modules.get("mpi4py.MPI")
    rank = ""
    try:
        if MPI is not None and MPI.Is_initialized() and not MPI.Is_finalized():
            rank = f"[rank {MPI.COMM_WORLD.Get_rank()}] "
    except Exception:
        pass
    if issubclass(exc_type, JobError):  # raised by every rank together: one line, from rank 0
        if rank in ("", "[rank 0] "):
            abort(f"zerompi: error: {exc}", exc.exit_code)
        time.sleep(2.0)  # let rank 0 print before this rank's abort ends the job
        abort("", exc.exit_code)
    code = 130 if exc_type is KeyboardInterrupt else 1
    if getattr(exc, "user_error", False):  # bad input (data_check.DataError): the message says it all
        msg, code = f"zerompi: error: {exc}", 2
    else:
        try:
            msg = "".join(traceback.format_exception(exc_type, exc, tb))
        except Exception:  # a broken __str__ must not cost the report
            msg = f"{getattr(exc_type, '__name__', exc_type)} (traceback could not be formatted)\n"
    text = "".join(f"{rank}{line}\n" for line in msg.rstrip("\n").split("\n"))
    abort(text, code)


def abort(message: str, code: int = 1) -> None:
    """Print `message` to stderr and end the whole job with exit status `code` (MPI_Abort
    in a multi-rank job). Safe from any thread: the watchdog calls it while the main
    thread is blocked in MPI."""
    for f in (sys.stdout, sys.stderr):  # earlier output first, in order
        try:
            f.flush()
        except Exception:
            pass
    if message:
        _write_all(2, (message if message.endswith("\n") else message + "\n").encode("utf-8", "replace"))
    MPI = sys.modules.get("mpi4py.MPI")
    try:
        if MPI is not None and MPI.Is_initialized() and not MPI.Is_finalized() \
                and MPI.COMM_WORLD.Get_size() > 1:
            _drain(1, 2.0)
            _drain(2, 5.0)  # the traceback has left this process before the abort
            MPI.COMM_WORLD.Abort(code)
    except Exception:
        pass
    os._exit(code)


def install_abort_hook() -> None:
    """Make an uncaught exception on any rank (or thread) abort the whole MPI job."""
    global _hook_installed
    if _hook_installed:
        return
    _hook_installed = True
    sys.excepthook = _abort_excepthook
    threading.excepthook = lambda a: _abort_excepthook(a.exc_type, a.exc_value, a.exc_traceback)


def init() -> Any:
    """Initialise MPI (idempotent), install the abort hook, return COMM_WORLD."""
    if not faulthandler.is_enabled():
        # a crash inside torch (e.g. an elementwise read of a released stage-3 parameter,
        # whose storage is empty) prints this rank's Python stack instead of a bare signal
        faulthandler.enable()
    install_abort_hook()
    fix_mmap_threshold()
    return mpi().COMM_WORLD


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
    then costs a fault. Measured on "vm" (stage 3, benchmarks/results/compare_mmap_threshold.*,
    before the gather pool, when gathered units went through malloc too): 135M GPT at
    N = 4, peak RSS in steps 1.67 -> 1.13 GiB per rank, step time 9.9 -> 11.4 s; geometric
    mean over 17M/135M at N = 2, 4: RSS x0.79, step time x1.24. With the pool the default
    gives 1.19-1.23 GiB there, pinned 1.13 (one run)."""
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


def agree(comm, errors=None) -> list[tuple[int, str, str]]:
    """The one way ranks agree on failures. Collective: every rank passes what went wrong
    on it (None, one exception or message, or a list of them); every rank gets back the
    same list of (rank, exception class name, message), in rank order, duplicates
    dropped. A rank that failed alone therefore never leaves the others waiting in a
    collective it will not join: all of them see the failure at the same point."""
    if errors is None:
        errors = []
    elif isinstance(errors, (str, BaseException)):
        errors = [errors]
    mine = [(type(e).__name__ if isinstance(e, BaseException) else "", str(e)) for e in errors]
    everyone = comm.allgather_object(mine) if comm.size > 1 else [mine]
    out, seen = [], set()
    for r, items in enumerate(everyone):
        for cls, msg in items:
            if msg not in seen:
                seen.add(msg)
                out.append((r, cls, msg))
    return out


def raise_agreed(comm, errors=None, context: str = "", exc_type: type = ValueError,
                 keep_types=(TypeError, ValueError), limit: int = 8) -> None:
    """agree(), then raise on every rank if any rank failed: "context: rank R: message"
    (no rank prefix in a 1-rank job), or "context: K problems:" and one such line per
    distinct message (at most `limit`). The exception keeps the failures' own class
    when they all share one of `keep_types` (bad arguments stay TypeError/ValueError);
    otherwise it is exc_type."""
    found = agree(comm, errors)
    if not found:
        return
    classes = {cls for _, cls, _ in found}
    cls = next((t for t in keep_types if classes == {t.__name__}), exc_type)
    lines = [msg if comm.size == 1 else f"rank {r}: {msg}" for r, _, msg in found]
    head = f"{context}: " if context else ""
    if len(lines) == 1:
        raise cls(head + lines[0])
    more = f"\n  ... and {len(lines) - limit} more" if len(lines) > limit else ""
    raise cls("\n  ".join([f"{head}{len(lines)} problems:"] + lines[:limit]) + more)


class JobError(Exception):
    """An error every rank raises at the same point, after agreeing on it (a diverged
    run, a locked run directory, a checkpoint that does not fit): a caller can end the
    job cleanly with `exit_code` and one message from rank 0, without MPI_Abort and
    without a traceback per rank."""

    exit_code = 1


def one_line_job_errors(prog: str):
    """Decorator for a job's main(): a JobError (raised by every rank together) becomes
    one line from rank 0 and its exit code, instead of a traceback per rank."""
    def wrap(fn):
        def main(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except JobError as e:
                if mpi().COMM_WORLD.Get_rank() == 0:
                    print(f"{prog}: error: {e}", file=sys.stderr, flush=True)
                return e.exit_code
        return main
    return wrap


def first_difference(a: Any, b: Any, key: str = "") -> tuple[str, Any, Any] | None:
    """(dotted key, a's value, b's value) of the first place where two nested
    dicts/lists differ, or None when they are equal."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in list(a) + [k for k in b if k not in a]:
            d = first_difference(a.get(k, "<missing>"), b.get(k, "<missing>"), f"{key}.{k}" if key else str(k))
            if d:
                return d
        return None
    return None if a == b else (key or "value", a, b)


def same_everywhere(comm, value: Any, what: str) -> list[str]:
    """Collective: one message per rank whose `value` (any picklable, e.g. a config dict,
    a data fingerprint, a count) differs from rank 0's, naming the dotted key and both
    values; the same list on every rank. The one check of things ranks must share."""
    everyone = comm.allgather_object(value) if comm.size > 1 else [value]
    out = []
    for r, v in enumerate(everyone[1:], start=1):
        d = first_difference(v, everyone[0])
        if d:
            k, mine, ref = d
            out.append(f"rank {r} has a different {what} than rank 0: {k} = {mine!r} (rank 0: {ref!r})")
    return out


def check_same_everywhere(comm, config: dict, shapes: list) -> None:
    """Ranks with different configs or models would issue mismatched collectives (a hang
    or garbage): compare once at set-up (one pickled allgather) and raise on every rank,
    naming the first differing rank, key and values, or parameter."""
    problems = same_everywhere(comm, {"config": config, "model": [list(s) for s in shapes]}, "setup")
    if problems:
        msg = problems[0].replace("different setup", "different config", 1).replace(": config.", ": ", 1)
        if ": model" in msg:
            everyone = comm.allgather_object(shapes)
            r = int(msg.split()[1])
            pad = [None] * (abs(len(everyone[r]) - len(everyone[0])) + 1)
            mine, ref = next((x, y) for x, y in zip(everyone[r] + pad, everyone[0] + pad) if x != y)
            msg = f"rank {r} has a different model than rank 0: parameter {mine} vs {ref}"
        raise ValueError(msg)


def seed_everything(seed: int, rank: int) -> None:
    """Seed python, numpy and torch with seed + rank (dropout/data differ per rank;
    model initialisation is made identical by a broadcast from rank 0, not by seeds)."""
    import torch

    s = (int(seed) + int(rank)) % (2**63)
    random.seed(s)
    np.random.seed(s % (2**32))
    torch.manual_seed(s)


def local_rank(comm) -> tuple[int, int]:
    """(node-local rank, ranks on this node) from an MPI shared-memory split."""
    MPI = mpi()
    from .watchdog import waiting

    with waiting("split_type"):
        node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    try:
        return node.Get_rank(), node.Get_size()
    finally:
        node.Free()
