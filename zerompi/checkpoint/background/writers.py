"""Where an asynchronous save's bytes are written: a thread per save in the rank, which
copies the snapshot and then writes the file in the rank itself (writer "thread") or
hands it to the rank's helper process (writer "process", helper.py); the same
for rank 0's index.h5 and manifest once every rank's file is written.

Either way the writer runs at a lower CPU priority than training (WRITER_NICE): when
ranks use every core (a CPU run with ranks = cores) it takes a small share of the time
it competes for, so the training steps around a background write stay close to their
usual time and the write takes longer; with idle cores (a GPU node's host) it runs at
full speed. It uses no MPI at all: everything collective stays on the training thread.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

from ..index import write_metadata
from ..rankfile_h5 import write_staged
from .helper import RemoteError, recv, send

WRITER_KINDS = ("thread", "process")
# CFS weights: nice 19 gets ~1.5% of a core that a nice-0 thread keeps busy (nice 10:
# ~10%), and all of it while training waits; the write's CPU time is the same either
# way, nice 19 only spreads it over more steps.
WRITER_NICE = int(os.environ.get("ZEROMPI_CHECKPOINT_WRITER_NICE", "19"))


def _lower_priority(nice: int) -> None:
    """Lower this thread's priority (Linux: setpriority on a thread id is per thread).
    Without privileges a priority never goes back up, hence a fresh thread per save."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except (OSError, AttributeError):
        pass


class ThreadWriter:
    """Writes in the calling (background) thread itself, at low priority."""

    kind = "thread"

    def __init__(self, nice: int = WRITER_NICE):
        self.nice = nice

    def write(self, path: str, job: dict, staging) -> tuple[str, int]:
        _lower_priority(self.nice)
        return write_staged(path, job, staging.array)

    def write_meta(self, tmp: str, manifest: dict) -> None:
        _lower_priority(self.nice)
        write_metadata(tmp, manifest)

    def close(self) -> None:
        pass


class ProcessWriter:
    """The rank's helper process. Started on the training thread: PR_SET_PDEATHSIG fires
    when the *thread* that started the helper ends, and that one lives as long as the
    rank. One request at a time (the save protocol never has two)."""

    kind = "process"

    def __init__(self, staging, nice: int = WRITER_NICE):
        if staging.fd is None:
            raise RuntimeError("checkpoint writer = process needs memfd_create (Linux)")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "zerompi.checkpoint.background.helper", str(staging.fd),
             str(staging.nbytes), str(nice), str(os.getpid())],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, pass_fds=(staging.fd,), start_new_session=True)

    def _ask(self, request):
        try:
            send(self.proc.stdin, request)
            reply = recv(self.proc.stdout)
        except OSError:   # a broken pipe: the helper is gone
            reply = None
        if reply is None:
            code = self.proc.wait()
            raise RuntimeError(f"the checkpoint writer process ended (exit status {code})")
        if reply[0] == "error":
            raise RemoteError(*reply[1:])
        return reply[1]

    def write(self, path: str, job: dict, staging) -> tuple[str, int]:
        return self._ask(("rank", path, job))

    def write_meta(self, tmp: str, manifest: dict) -> None:
        self._ask(("meta", tmp, manifest))

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()


class Task(threading.Thread):
    """One background step of a save. Never raises: the training thread reads the
    outcome (finished, result, error, seconds)."""

    def __init__(self, name: str, fn):
        super().__init__(name=name, daemon=True)  # an exit never waits on an unpublished save
        self.fn, self.result, self.error = fn, None, None
        self.seconds = 0.0
        self.finished = threading.Event()

    def run(self) -> None:
        t0 = time.perf_counter()
        try:
            self.result = self.fn()
        except BaseException as e:   # reported on every rank by the training thread
            self.error = e
        finally:
            self.seconds = time.perf_counter() - t0
            self.finished.set()


def save_task(snapshot, writer, staging, path: str) -> Task:
    """A rank's background save: the snapshot's host copies (at normal priority: the
    engine's next update waits for them), then the file."""
    def run():
        snapshot.copy()
        snapshot.finish()
        return writer.write(path, snapshot.job, staging)
    return Task("zerompi-ckpt-save", run)
