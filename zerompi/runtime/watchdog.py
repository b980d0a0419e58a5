"""Deadlines on every collective wait, and stop signals that reach a blocked rank.

A blocking MPI call cannot be interrupted from Python, and a Python signal handler
runs only when the main thread is back in the interpreter, so a rank whose peer is
stopped (a dead node, a hung GPU, SIGSTOP) would wait forever and ignore SIGTERM.
Here the main thread only marks what it waits for (`with waiting("all_reduce"):`,
done by the communicator for every collective and Handle.wait); a daemon thread checks
the deadline four times a second and, on expiry:
  1. asks every other rank where it is over the side channel (sidechannel.py: UDP,
     answered by the other ranks' watchdog threads, which run while their main thread
     is blocked in MPI). This thread makes no MPI call but the final abort: an MPI send
     to a lost rank from here, while the main thread is inside MPI, segfaulted;
  2. prints one line naming this rank, the collective, the step, and the ranks that did
     not answer (stopped or dead) or are somewhere else, and waits until it has left;
  3. ends the whole job through abort.abort (MPI_Abort, exit EXIT_TIMEOUT), guarded so
     that a crash or a hang inside MPI_Abort still ends this process with that status.

Stop signals (install_stop_signals, used by `python -m zerompi.train`): the Python
handler sets a flag that the loop reads between steps, where the ranks agree and
checkpoint together; `signal.set_wakeup_fd` also tells this thread at once. After
SIGTERM/SIGINT, a wait that does not complete within `stop_grace_s` means the ranks can
no longer agree: the job ends without writing a partial checkpoint (exit 128 + signal).
A second SIGINT ends it at once.

Deadlines: `timeout_s` per wait once the first optimizer step is done; before that, and
inside `generous()` (checkpoint I/O, where ranks wait for the slowest writer),
`startup_timeout_s`. 0 turns a deadline off. Per process, like the abort hook: a rank
has one main thread that can block, whatever the communicators. Inside `generous()` a
wait past `timeout_s` also asks the others every `timeout_s`: a slow writer's watchdog
answers (HDF5, hashing and torch release the GIL), a rank on a lost node does not, and
ranks silent twice in a row end the job then, not at `startup_timeout_s`.
"""
from __future__ import annotations

import atexit
import os
import select
import signal
import socket
import threading
import time
from contextlib import contextmanager

from . import sidechannel
from .abort import abort

EXIT_TIMEOUT = 3
_POLL_S = 0.25
_ASK_S = 3.0          # how long an expiring rank waits for the others' answers
_ASK_MAX_RANKS = 256  # above this, asking every rank costs more than it tells


class _State:
    timeout_s = 300.0
    startup_timeout_s = 1200.0
    stop_grace_s = 10.0
    op: str | None = None      # what the main thread waits for now
    since = 0.0
    generous = 0
    probed = (None, 0.0, 0.0)  # (op, since) of the wait last asked about, and when
    label = ""                 # what the waits belong to ("checkpoint save")
    progress = None            # callable -> (step, first step done)
    stop_sig = 0               # first stop signal seen by the Python handler
    stop_at: float | None = None   # when the thread learnt of SIGTERM/SIGINT
    stop_at_sig = 0                # ... and which
    sigints = 0
    agreed = False             # the ranks agreed to stop: normal deadlines again
    thread: threading.Thread | None = None
    wake_r: socket.socket | None = None
    wake_w: socket.socket | None = None
    closing = False
    side = sidechannel.Channel()   # this rank's side channel: only this module's thread reads it


S = _State()
_lock = threading.Lock()  # the thread's abort (MPI_Abort) vs. MPI_Finalize at exit


def configure(timeout_s: float | None = None, startup_timeout_s: float | None = None,
              stop_grace_s: float | None = None) -> None:
    if timeout_s is not None:
        S.timeout_s = float(timeout_s)
    if startup_timeout_s is not None:
        S.startup_timeout_s = float(startup_timeout_s)
    if stop_grace_s is not None:
        S.stop_grace_s = float(stop_grace_s)


def configure_from(comm_cfg) -> None:
    """Deadlines from a CommConfig (zero.comm.timeout_s ...)."""
    configure(comm_cfg.timeout_s, comm_cfg.startup_timeout_s, comm_cfg.stop_grace_s)


def attach(progress) -> None:
    """`progress()` -> (step in progress, first step done): named in messages; picks
    the deadline."""
    S.progress = progress


def watch_engine(engine) -> None:
    """Deadlines from engine.config.comm; messages name its optimizer step, and the
    generous start-up deadline holds until its first update (weak reference: the
    watchdog never keeps an engine alive)."""
    import weakref

    configure_from(engine.config.comm)
    ref = weakref.ref(engine)

    def progress():
        e = ref()
        if e is None:
            return None, False
        done = e.micro_steps // e.gradient_accumulation_steps  # skipped steps count, as in the loop
        return done + 1, done >= 1  # the step in progress, 1-based like metrics.jsonl

    attach(progress)


def _step() -> tuple[int | None, bool]:
    try:
        return S.progress() if S.progress else (None, False)
    except Exception:
        return None, False


@contextmanager
def waiting(op: str):
    """Mark a collective wait of the main thread (nested marks keep the outer one)."""
    if S.thread is None:
        _start()
    outer = S.op is not None
    if not outer:
        S.since, S.op = time.monotonic(), op
    try:
        yield
    finally:
        if not outer:
            S.op = None


@contextmanager
def within(label: str):
    """Name the public call the waits inside belong to ("engine.backward"): messages
    say "all_reduce at step 3 during engine.backward". No deadline of its own."""
    outer, S.label = S.label, label
    try:
        yield
    finally:
        S.label = outer


@contextmanager
def generous(label: str):
    """Waits inside get startup_timeout_s (checkpoint save/load: ranks wait for the
    slowest writer, which may take minutes on a big model); `label` goes in messages."""
    S.generous += 1
    outer, S.label = S.label, S.label or label
    try:
        yield
    finally:
        S.generous -= 1
        S.label = outer


# ---------------------------------------------------------------- stop signals
def _on_signal(signum, frame) -> None:
    if not S.stop_sig or signum != signal.SIGUSR1:  # TERM/INT outrank USR1
        S.stop_sig = signum


def install_stop_signals() -> None:
    """SIGUSR1 (checkpoint and stop), SIGTERM and SIGINT (the same, within stop_grace_s
    when blocked; a second SIGINT aborts). Call from the main thread."""
    r, w = socket.socketpair()
    r.setblocking(False)
    w.setblocking(False)
    S.wake_r = r
    for s in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
        signal.signal(s, _on_signal)
    signal.set_wakeup_fd(w.fileno(), warn_on_full_buffer=False)
    S.wake_w = w  # keep the write end open
    if S.thread is None:
        _start()


def stop_signal() -> int:
    """The stop signal received so far on this rank (0 if none)."""
    return S.stop_sig


def stop_agreed() -> None:
    """The ranks agreed to stop (they can still communicate): checkpoint with the
    normal deadlines."""
    S.agreed = True


# ---------------------------------------------------------------- the thread
def _start() -> None:
    with _lock:
        if S.thread is not None:
            return
        S.thread = threading.Thread(target=_loop, name="zerompi-watchdog", daemon=True)
        S.thread.start()
    atexit.register(close)  # runs before mpi4py's MPI_Finalize (registered earlier)


def close() -> None:
    """No more aborts (MPI_Abort) from the thread: call before MPI_Finalize."""
    with _lock:
        S.closing = True


def _status() -> tuple:
    step, _ = _step()
    op = S.op
    return (op, round(time.monotonic() - S.since, 1) if op else 0.0, step)


def side_address() -> tuple:
    """Open this rank's side-channel socket; what the other ranks need to reach it
    (parallel.nodes.discover gathers it with the host names)."""
    if S.thread is None:
        _start()
    return S.side.open_socket()


def side_peers(rank: int, table: list) -> None:
    """Every COMM_WORLD rank's side_address(), indexed by rank: the survey can ask them."""
    S.side.set_peers(rank, table)


def _loop() -> None:
    while True:
        fds = [f for f in (S.wake_r.fileno() if S.wake_r is not None else None, S.side.fileno())
               if f is not None]
        ready = []
        if fds:
            try:
                ready, _, _ = select.select(fds, [], [], _POLL_S)
            except (OSError, ValueError):
                time.sleep(_POLL_S)
        else:
            time.sleep(_POLL_S)
        if S.wake_r is not None and S.wake_r.fileno() in ready:
            try:
                data = S.wake_r.recv(64)
            except OSError:
                data = b""
            for signum in data:
                _thread_signal(signum)
        try:
            S.side.serve(_status)  # other ranks asking where this one is
        except Exception:
            pass
        with _lock:  # an abort here vs. MPI_Finalize at exit (close())
            if S.closing:
                S.side.close()
                return
            _check()


def _thread_signal(signum: int) -> None:
    if signum in (signal.SIGTERM, signal.SIGINT) and S.stop_at is None:
        S.stop_at, S.stop_at_sig = time.monotonic(), signum
    if signum == signal.SIGINT:
        S.sigints += 1
        if S.sigints >= 2:
            _expire("a second SIGINT: stopping now, without a checkpoint", 128 + signal.SIGINT)


def _check() -> None:
    op, since = S.op, S.since
    if op is None:
        return
    now = time.monotonic()
    step, running = _step()
    limit = S.startup_timeout_s if (S.generous or not running) else S.timeout_s
    key = "startup_timeout_s" if (S.generous or not running) else "timeout_s"
    at = (f" at step {step}" if step is not None else "") + (f" during {S.label}" if S.label else "")
    if limit > 0 and now - since > limit:
        _expire(f"{op}{at} not complete after {limit:g} s (zero.comm.{key})", EXIT_TIMEOUT, op, step)
    if S.generous and running and 0 < S.timeout_s < now - since:
        _probe(op, since, at, step, now, limit)
    sig = S.stop_at_sig  # the main thread's handler may not have run yet: it is blocked
    if S.stop_at is not None and not S.agreed and S.stop_grace_s > 0 \
            and now - max(since, S.stop_at) > S.stop_grace_s:
        name = signal.Signals(sig).name
        _expire(f"{name} received, but {op}{at} has not completed in the {S.stop_grace_s:g} s since "
                f"(zero.comm.stop_grace_s): the ranks cannot agree to checkpoint, so none is written",
                128 + sig, op, step)


def _probe(op, since, at, step, now, limit) -> None:
    """Inside a generous wait past timeout_s, every timeout_s: ranks that answer neither
    of two askings in a row are gone (a lost node), not slow: end the job now."""
    if S.probed[:2] == (op, since) and now - S.probed[2] < S.timeout_s:
        return
    S.probed = (op, since, now)
    if not S.side.ready() or len(S.side.peers) >= _ASK_MAX_RANKS:
        return  # nobody to ask: the generous deadline decides
    silent, _ = _survey(op, step)
    if not silent:
        return
    again, detail = _survey(op, step)
    if set(silent) & set(again) and (S.op, S.since) == (op, since):
        _expire(f"{op}{at} not complete after {S.timeout_s:g} s (zero.comm.timeout_s; up to zero.comm."
                f"startup_timeout_s = {limit:g} s is allowed for slow writers, not for ranks that are gone)",
                EXIT_TIMEOUT, op, step, detail)


def _survey(op, step) -> tuple[list[int], str]:
    """Who is not with us: ask every rank over the side channel, wait _ASK_S for
    answers; (silent ranks, text)."""
    peers = sorted(S.side.peers)
    if len(peers) + 1 > _ASK_MAX_RANKS:
        return [], f" ({len(peers) + 1} ranks: not asking each where it is)"
    answers = S.side.survey(_status, _ASK_S)
    silent = [q for q in peers if q not in answers]
    same = sorted(q for q, (o, _, s) in answers.items() if o == op and s == step)
    elsewhere = [(q, a) for q, a in sorted(answers.items()) if q not in same]
    parts = []
    if silent:
        parts.append(f"{_ranks(silent)} did not answer within {_ASK_S:g} s (stopped, dead or hung: "
                     "the likely cause)")
    for q, (o, waited, s) in elsewhere[:8]:
        where = f"waits in {o} for {waited:g} s" if o else "is not in a collective"
        parts.append(f"rank {q} {where}" + (f" at step {s}" if s is not None else ""))
    if same:
        parts.append(f"{_ranks(same)} wait{'s' if len(same) == 1 else ''} in the same collective")
    return silent, "; " + "; ".join(parts) if parts else ""


_rank_namer = None  # COMM_WORLD ranks -> "ranks 2, 3 (all of node n2)" (ParallelDims sets it)


def name_ranks_with(namer) -> None:
    """Name the ranks in messages with `namer(ranks) -> str` (their nodes)."""
    global _rank_namer
    _rank_namer = namer


def _ranks(qs: list[int]) -> str:
    if _rank_namer is not None and len(qs) <= 16:
        try:
            return _rank_namer(qs)
        except Exception:  # a diagnosis must never stop the abort
            pass
    if len(qs) == 1:
        return f"rank {qs[0]}"
    shown = ", ".join(map(str, qs[:16])) + (f" and {len(qs) - 16} more" if len(qs) > 16 else "")
    return f"ranks {shown}"


def _expire(what: str, code: int, op: str | None = None, step: int | None = None,
            detail: str | None = None) -> None:
    """The line first (the survey is sockets only: it cannot crash), then the abort."""
    rank = S.side.rank if S.side.rank >= 0 else _world("RANK", "?")
    if detail is None and op is not None:
        if S.side.ready():
            try:
                detail = _survey(op, step)[1]
            except Exception as e:  # a diagnosis must never stop the abort
                detail = f" (could not ask the other ranks: {e})"
        elif _world("SIZE", "1") != "1":
            detail = " (the other ranks cannot be asked where they are: the job had not mapped its nodes yet)"
    abort(f"[rank {rank}] zerompi watchdog: {what}{detail or ''}. Ending the job.", code, from_thread=True)


def _world(what: str, default: str) -> str:
    """This rank's COMM_WORLD rank or size as the launcher's environment says (no MPI
    call from this thread; the side channel knows the rank once the nodes are mapped)."""
    slurm = {"RANK": "SLURM_PROCID", "SIZE": "SLURM_NTASKS"}[what]
    for k in (f"PMI_{what}", f"OMPI_COMM_WORLD_{what}", f"PMIX_{what}", slurm):
        if os.environ.get(k, "").isdigit():
            return os.environ[k]
    return default
