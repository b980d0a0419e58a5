"""MPI start-up, whole-job abort on any rank's exception, per-rank seeding.

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

from .malloc import fix_mmap_threshold

_hook_installed = False
EXIT_PAUSE_S = 0.3  # exit_together: a rank's Finalize tail took 7 ms on an idle node; ~40x that for a loaded one


def mpi():
    """The mpi4py.MPI module (initialises MPI on first use, under the start-up deadline
    of runtime/startup.py)."""
    MPI = sys.modules.get("mpi4py.MPI")
    if MPI is None:
        from .startup import import_mpi

        MPI = import_mpi()
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
        if rank in ("", "[rank 0] ") and not exc.quiet:
            abort(f"zerompi: error: {exc}", exc.exit_code)
        time.sleep(2.0)  # let rank 0 print before this rank's abort ends the job
        abort("", exc.exit_code)
    if getattr(exc, "rank_0_speaks", False):  # a bad config: ranks that load the same one raise it together
        if rank in ("", "[rank 0] "):
            abort(f"zerompi: error: {exc}", 2)
        time.sleep(2.0)  # rank 0's abort ends this rank first when it raised too
        abort(f"{rank}zerompi: error: {exc}", 2)
    code = 130 if exc_type is KeyboardInterrupt else 1
    if getattr(exc, "user_error", False):  # bad input (data.check.DataError): the message says it all
        msg, code = f"zerompi: error: {exc}", 2
    else:
        try:
            msg = "".join(traceback.format_exception(exc_type, exc, tb))
        except Exception:  # a broken __str__ must not cost the report
            msg = f"{getattr(exc_type, '__name__', exc_type)} (traceback could not be formatted)\n"
    text = "".join(f"{rank}{line}\n" for line in msg.rstrip("\n").split("\n"))
    abort(text, code)


def abort(message: str, code: int = 1, from_thread: bool = False) -> None:
    """Print `message` to stderr and end the whole job with exit status `code` (MPI_Abort
    in a multi-rank job). Safe from any thread: the watchdog calls it (`from_thread`)
    while the main thread is blocked in MPI, where MPI_Abort is guarded (_guard_abort)."""
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
            if from_thread:
                _guard_abort(code)
            MPI.COMM_WORLD.Abort(code)
    except Exception:
        pass
    os._exit(code)


ABORT_GRACE_S = 10.0  # MPI_Abort from the watchdog thread: its own end comes no later


def _guard_abort(code: int) -> None:
    """Before MPI_Abort from a thread while the main thread may be inside MPI: MPICH's
    abort tells the launcher (which then ends every rank with `code`) and calls exit(),
    whose library teardown races with the main thread's MPI call. The message is out
    already; what remains must not turn into a crash report or a hang. So: a crash in
    that teardown ends this process quietly (SIGSEGV/SIGBUS/SIGILL/SIGFPE -> _exit,
    no faulthandler or UCX dump), and a timer thread ends it with `code` if MPI_Abort
    has not returned or ended it within ABORT_GRACE_S."""
    import ctypes
    import signal

    def later():
        time.sleep(ABORT_GRACE_S)
        os._exit(code)

    threading.Thread(target=later, name="zerompi-abort-timer", daemon=True).start()
    try:
        faulthandler.disable()
        libc = ctypes.CDLL(None, use_errno=True)
        libc.signal.restype, libc.signal.argtypes = ctypes.c_void_p, [ctypes.c_int, ctypes.c_void_p]
        quiet_exit = ctypes.cast(libc._exit, ctypes.c_void_p).value
        for sig in (signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE):
            libc.signal(int(sig), quiet_exit)
    except Exception:  # no libc to call: MPI_Abort unguarded, the timer still holds
        pass


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
    world = mpi().COMM_WORLD
    from .startup import env_rank, mismatch

    line = mismatch(world.Get_size())  # a launch of N tasks that became N worlds of 1
    if line is not None:
        raise LaunchMismatch(line, quiet=env_rank() not in (None, 0))
    return world


class JobError(Exception):
    """An error every rank raises at the same point, after agreeing on it (a diverged
    run, a locked run directory, a checkpoint that does not fit): a caller can end the
    job cleanly with `exit_code` and one message from rank 0, without MPI_Abort and
    without a traceback per rank."""

    exit_code = 1
    quiet = False  # True where another process (the launcher's rank 0) prints the line


class LaunchMismatch(JobError):
    """The launcher started N tasks and MPI gave this one a world of 1 (runtime/startup.py).
    Every one-rank world raises it: only the launcher's rank 0 prints, exit 2."""

    exit_code = 2

    def __init__(self, message: str, quiet: bool):
        super().__init__(message)
        self.quiet = quiet


def one_line_job_errors(prog: str):
    """Decorator for a job's main(): a JobError (raised by every rank together) becomes
    one line from rank 0 and its exit code, instead of a traceback per rank."""
    def wrap(fn):
        def main(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except JobError as e:
                if e.quiet:
                    time.sleep(2.0)  # the speaker prints before a launcher ends the job at this exit
                elif mpi().COMM_WORLD.Get_rank() == 0:
                    print(f"{prog}: error: {e}", file=sys.stderr, flush=True)
                return e.exit_code
        return main
    return wrap


def seed_everything(seed: int, rank: int) -> None:
    """Seed python, numpy and torch with seed + rank (dropout/data differ per rank;
    model initialisation is made identical by a broadcast from rank 0, not by seeds)."""
    import torch

    s = (int(seed) + int(rank)) % (2**63)
    random.seed(s)
    np.random.seed(s % (2**32))
    torch.manual_seed(s)


def exit_together(code: int, world, before=(), stop_mpi_users=()) -> None:
    """Every rank leaves at once with a non-zero CODE (124: checkpointed, requeue me).
    `srun --kill-on-bad-exit` ends the step when the first task exits non-zero, so a rank
    still tearing down (rank 0 freeing the run lock, the interpreter unloading torch) would
    be killed and the step end with 143, not CODE. So: the teardown that matters first
    (`before`: callables), a barrier (under the watchdog), `stop_mpi_users` (threads that
    call MPI, the watchdog's), MPI_Finalize (a skipped one leaves MPICH segments named
    after the Slurm job and step, which the requeued job, same names, would attach to and
    die in MPI_Init), a pause, then os._exit without the interpreter's slow exit.

    The pause: mpiexec (hydra) kills the other ranks as soon as one exits. A rank killed
    after its Finalize reached the process manager goes unreported and the job's status
    is CODE (checked: a rank sleeping after Finalize while another exits). Finalize waits
    for every rank, then each still runs a few ms of tail; a rank killed there is, by our
    reading of the one failure seen (a 2-rank stop on the loaded 2-core VM, ~60 runs), a
    "BAD TERMINATION" with status 9 instead of 124.
    Under srun every rank exits CODE at nearly the same moment, pause or not."""
    for fn in before:
        fn()
    for t in threading.enumerate():  # as interpreter exit would (a checkpoint rotation's delete)
        if t is not threading.main_thread() and not t.daemon:
            t.join()
    sys.stdout.flush()
    sys.stderr.flush()
    world.barrier()
    for fn in stop_mpi_users:
        fn()
    mpi().Finalize()
    time.sleep(EXIT_PAUSE_S)  # every rank's Finalize done before the first exit (above)
    os._exit(code)
