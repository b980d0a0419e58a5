"""One job per run directory, and what dead jobs leave behind on a node.

RunLock: `RUN_DIR/.lock` names the job that uses the directory (host, pid, Slurm job
id and restart count). A second job fails at once naming that holder, instead of mixing
its metrics and deleting the other's temporary checkpoints. The lock is created with
O_EXCL (atomic on local and network filesystems), refreshed every HEARTBEAT_S by a
daemon thread, and taken over only when its holder is provably gone: its pid is dead on
this host, it is an earlier incarnation of this very Slurm job (a requeue), or its
heartbeat stopped (another host, STALE_S without a refresh). Takeover renames the stale
file aside and checks that what it moved is what it judged stale, so two jobs racing
for one stale lock cannot both win.

clean_dead_shm: MPICH keeps its intra-node shared memory in /dev/shm/mpich_shm_* and a
killed job never unlinks it. At start, a node's first rank removes the segments of this
user that no live process maps (and that are not brand new), so they cannot pile up.
"""
from __future__ import annotations

import atexit
import json
import os
import secrets
import socket
import threading
import time
from pathlib import Path

from .abort import JobError
from .agree import agree
from .console import say

LOCK = ".lock"
HEARTBEAT_S = 30.0
STALE_S = 300.0


class RunDirBusy(JobError):
    exit_code = 5


def identity() -> dict:
    """This process as a lock or marker file records it (a holder a later job can check)."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "start": start_time(os.getpid()),
            "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
            "slurm_restart_count": int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0),
            "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def start_time(pid: int) -> str | None:
    """Kernel start time of a live process (guards against a recycled pid); None when it
    is gone or a zombie (dead: in containers whose init does not reap, killed ranks stay
    zombies indefinitely)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    if len(fields) < 20 or fields[0] in ("Z", "X"):
        return None
    return fields[19]


def describe(holder: dict) -> str:
    job = f", Slurm job {holder['slurm_job_id']}" if holder.get("slurm_job_id") else ""
    return f"host {holder.get('host')}, pid {holder.get('pid')}{job}, since {holder.get('since')}"


def _stale(holder: dict, age: float, me: dict) -> str | None:
    """Why the holder is gone, or None while it may be alive."""
    if holder.get("slurm_job_id") and holder["slurm_job_id"] == me["slurm_job_id"] \
            and holder.get("slurm_restart_count", 0) < me["slurm_restart_count"]:
        return "an earlier run of this Slurm job (requeued)"
    if holder.get("host") == me["host"]:
        pid = holder.get("pid")
        if not isinstance(pid, int) or start_time(pid) is None:
            return "its process is gone"
        if holder.get("start") and start_time(pid) != holder["start"]:
            return "its process is gone (pid reused)"
        return None
    if age > STALE_S:
        return f"not refreshed for {age:.0f} s"
    return None


class RunLock:
    """Held by one process (rank 0) of the job; release() or process exit ends it."""

    def __init__(self, run_dir: str | os.PathLike):
        self.path = Path(run_dir) / LOCK
        self.me = identity()
        self._stop = threading.Event()
        self.took_over: str | None = None

    def acquire(self) -> "RunLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(self.me)
        for _ in range(3):
            if self._create(text):
                break
            holder, age = self._read()
            if holder is None:  # vanished meanwhile, or unreadable garbage: retry/replace
                if age is not None and age > 5:
                    self._take_over(None, "unreadable")
                continue
            why = _stale(holder, age, self.me)
            if why is None:
                raise RunDirBusy(f"run directory {self.path.parent} is in use by another job "
                                 f"({describe(holder)}); wait for it to end, or use another --run_dir "
                                 f"(if that job is dead, remove {self.path})")
            self._take_over(holder, why)
        else:
            raise RunDirBusy(f"run directory {self.path.parent}: could not take the lock {self.path}")
        threading.Thread(target=self._beat, name="zerompi-runlock", daemon=True).start()
        atexit.register(self.release)  # a clean exit frees it; a killed job leaves a stale one
        return self

    def _create(self, text: str) -> bool:
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            f.write(text)
        return True

    def _read(self) -> tuple[dict | None, float | None]:
        try:
            age = time.time() - self.path.stat().st_mtime
            return json.loads(self.path.read_text()), age
        except FileNotFoundError:
            return None, None
        except (OSError, ValueError):
            return None, age

    def _take_over(self, holder: dict | None, why: str) -> None:
        aside = self.path.with_name(f"{LOCK}.stale-{secrets.token_hex(4)}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return  # someone else moved it: race again through O_EXCL
        try:
            moved = json.loads(aside.read_text())
        except (OSError, ValueError):
            moved = None
        if holder is not None and moved != holder:  # we moved a fresh lock: put it back
            os.rename(aside, self.path)
            raise RunDirBusy(f"run directory {self.path.parent} was just taken by another job "
                             f"({describe(moved or {})})")
        aside.unlink(missing_ok=True)
        self.took_over = f"took over the lock of {describe(holder or {})}: {why}"

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)
            except OSError:
                pass

    def release(self) -> None:
        self._stop.set()
        holder, _ = self._read()
        if holder == self.me:
            self.path.unlink(missing_ok=True)


def clean_dead_shm(folder: str = "/dev/shm", prefix: str = "mpich_shm_", min_age_s: float = 60.0,
                   only: set[str] | None = None) -> list[str]:
    """Remove this user's MPICH segments that no live process maps; returns their names.
    `only`: consider just these segment names (a launcher's own, say)."""
    try:
        entries = [e for e in os.scandir(folder) if e.name.startswith(prefix)
                   and (only is None or e.name in only)]
    except OSError:
        return []
    uid, now = os.getuid(), time.time()
    candidates = {e.path for e in entries
                  if e.stat(follow_symlinks=False).st_uid == uid and now - e.stat().st_mtime > min_age_s}
    if not candidates:
        return []
    mapped = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/maps") as f:
                mapped.update(line.rsplit(None, 1)[-1] for line in f if folder in line)
        except OSError:
            continue  # gone, or another user's (it cannot map our 0600 segments)
    removed = []
    for path in sorted(candidates - mapped):
        try:
            os.unlink(path)
            removed.append(os.path.basename(path))
        except OSError:
            pass
    return removed


def claim(run_dir: str | os.PathLike, world, local_rank: int) -> RunLock | None:
    """Collective: each node's first rank cleans dead jobs' shared memory, rank 0 takes
    the run directory's lock; every rank raises RunDirBusy together if it is held."""
    if local_rank == 0:
        removed = clean_dead_shm()
        if removed:
            say(f"removed {len(removed)} shared-memory segment(s) of dead jobs from /dev/shm", rank=0)
    lock, err = None, None
    if world.rank == 0:
        try:
            lock = RunLock(run_dir).acquire()
        except RunDirBusy as e:
            err = e
        except OSError as e:
            err = RunDirBusy(f"run directory {run_dir}: cannot create its lock ({e})")
    problems = agree(world, err)
    if problems:
        raise RunDirBusy(problems[0][2])
    if lock is not None and lock.took_over:
        say(f"run directory {run_dir}: {lock.took_over}", rank=0)
    return lock
