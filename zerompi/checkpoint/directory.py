"""The checkpoint directory: atomic publication, the `latest` pointer, rotation, lookup.

DIR/
  latest                 one line: the tag of the newest complete checkpoint
  TAG/                   complete checkpoints (manifest.json, index.h5, rank-*.h5)
  .tmp-TAG-XXXX/         a save in progress (.owner names its process), or the remains
                         of one that crashed: cleanup() removes only those whose owner is gone
  .old-TAG-XXXX/         a checkpoint moved aside while TAG is being replaced
  .latest.HOST-PID.XXXX.tmp  `latest` being replaced, or what a crash left of that

Crash safety comes from ordering: a checkpoint directory only ever appears under its
tag by rename(2) after every file in it is fsynced, and `latest` is replaced atomically
after that (zerompi.runtime.fileio.atomic_write: temporary .latest.*.tmp, fsync, rename, fsync
of DIR). Saving over an existing TAG needs two renames (TAG -> .old-TAG-X, then the
new one -> TAG); between them `latest` may name a TAG that is absent, so lookup falls
back to the newest complete .old-TAG-* (the previous checkpoint, intact).
"""
from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import threading
import time

from ..runtime.fileio import atomic_write, fsync_path
from . import manifest_json, naming
from .errors import CheckpointError

OWNER = ".owner"
OTHER_HOST_S = 6 * 3600  # a save on another host is taken for dead after this long


def publish(directory: str, tmp: str, tag: str) -> str:
    """Move the finished tmp dir to DIR/TAG (replacing an older TAG), then point
    `latest` at it. Every step is durable before the next one starts."""
    try:
        os.unlink(os.path.join(tmp, OWNER))  # not part of the checkpoint
    except FileNotFoundError:
        pass
    fsync_path(tmp)
    final = os.path.join(directory, tag)
    old = None
    if os.path.lexists(final):
        old = os.path.join(directory, f"{naming.OLD_PREFIX}{tag}-{secrets.token_hex(4)}")
        os.rename(final, old)
        fsync_path(directory)
    os.rename(tmp, final)
    fsync_path(directory)
    write_latest(directory, tag)
    if old:  # as rotate(background=True): the caller need not wait for GBs to be freed
        threading.Thread(target=shutil.rmtree, args=(old, True), name="zerompi-rotate").start()
    return final


def write_latest(directory: str, tag: str) -> None:
    atomic_write(os.path.join(directory, naming.LATEST), tag + "\n")


def mark_owner(tmp: str) -> None:
    """Record who writes into a temporary checkpoint directory (host, pid, start time),
    so that another job's cleanup leaves it alone while this process lives."""
    from ..runtime.rundir import identity

    with open(os.path.join(tmp, OWNER), "w") as f:
        json.dump(identity(), f)


def _owner_gone(path: str) -> bool:
    """True when the process that made a temporary directory is gone: dead on this host,
    silent for OTHER_HOST_S on another, or unknown (a crash left it before marking, or a
    publish/rotation step that never marks)."""
    from ..runtime.rundir import identity, start_time

    try:
        with open(os.path.join(path, OWNER)) as f:
            owner = json.load(f)
        age = time.time() - os.stat(os.path.join(path, OWNER)).st_mtime
    except (OSError, ValueError):
        return True
    if owner.get("host") != identity()["host"]:
        return age > OTHER_HOST_S
    return start_time(owner.get("pid", -1)) != owner.get("start")


def cleanup(directory: str) -> None:
    """Remove what crashed saves left behind (called after a successful save): only
    temporary directories whose owner is gone, never another live job's save in progress."""
    for entry in os.listdir(directory):
        p = os.path.join(directory, entry)
        if entry.startswith((naming.TMP_PREFIX, naming.OLD_PREFIX)) and os.path.isdir(p) and _owner_gone(p):
            shutil.rmtree(p, ignore_errors=True)
        elif entry.startswith(f".{naming.LATEST}.") and os.path.isfile(p) and _latest_tmp_gone(entry, p):
            try:
                os.unlink(p)
            except OSError:
                pass


def _latest_tmp_gone(entry: str, path: str) -> bool:
    """write_latest's temporary (.latest.HOST-PID.XXXX.tmp, fileio.atomic_file) lives
    milliseconds unless its writer crashed: gone when that pid is dead on this host, or
    (another host, or an older name without the owner) when it is older than 10 min."""
    from ..runtime.rundir import identity, start_time

    m = re.match(rf"^\.{naming.LATEST}\.(.+)-(\d+)\.[^.]+\.tmp$", entry)
    if m and m.group(1) == identity()["host"] and start_time(int(m.group(2))) is None:
        return True
    try:
        return time.time() - os.stat(path).st_mtime > 600
    except OSError:
        return False


def _created(path: str) -> int | None:
    """Creation stamp of a complete checkpoint directory, None if it is not one."""
    try:
        with open(os.path.join(path, naming.MANIFEST), "rb") as f:
            return int(manifest_json.unseal(f.read(), path)["created_ns"])
    except (OSError, CheckpointError, KeyError, ValueError, TypeError):
        return None


def list_checkpoints(directory: str) -> list[tuple[int, str]]:
    """(created_ns, tag) of the complete checkpoints in DIR, oldest first."""
    out = []
    for entry in os.listdir(directory):
        p = os.path.join(directory, entry)
        if entry.startswith(".") or not os.path.isdir(p):
            continue
        stamp = _created(p)
        if stamp is not None:
            out.append((stamp, entry))
    return sorted(out)


def rotate(directory: str, keep_last: int, current: str, background: bool = False) -> list[str]:
    """Keep the `keep_last` newest checkpoints (never removing `current`); returns the
    removed tags. Only directories holding a valid zerompi manifest are candidates.
    background=True deletes the renamed directories on a (non-daemon) thread: the save
    returns without waiting for the file system to free GBs (~0.4 s per 1.6 GB here);
    interpreter exit waits for it, and a kill leaves a .tmp-rm-* that cleanup() removes."""
    if keep_last is None or keep_last <= 0:
        return []
    ckpts = [t for _, t in list_checkpoints(directory)]
    doomed = [t for t in ckpts[:max(0, len(ckpts) - keep_last)] if t != current]
    for t in doomed:
        # Rename first: a crash mid-delete leaves a hidden dir that cleanup() removes,
        # never a half-deleted checkpoint under a visible tag.
        aside = os.path.join(directory, f"{naming.TMP_PREFIX}rm-{t}-{secrets.token_hex(4)}")
        os.rename(os.path.join(directory, t), aside)
        if background:
            threading.Thread(target=shutil.rmtree, args=(aside, True), name="zerompi-rotate").start()
        else:
            shutil.rmtree(aside, ignore_errors=True)
    return doomed


def read_latest(directory: str) -> str | None:
    """The tag in DIR/latest; None when there is no such file; CheckpointError if garbage."""
    path = os.path.join(directory, naming.LATEST)
    try:
        with open(path, "rb") as f:
            raw = f.read(4096)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e})") from None
    try:
        return naming.check_tag(raw.decode("utf-8").strip())
    except (UnicodeDecodeError, ValueError):
        raise CheckpointError(f"{path}: does not name a checkpoint tag "
                              f"(content {raw[:60]!r}); pass tag= (python -m zerompi.train: --resume_from TAG)") from None


def resolve(path: str, tag: str | None = None) -> str | None:
    """Directory of the checkpoint to load.

    `path` is DIR (then `tag`, or else DIR/latest, picks the checkpoint) or a checkpoint
    directory DIR/TAG itself. None when DIR holds no checkpoint at all (fresh start)."""
    path = os.path.abspath(os.fspath(path))
    if tag is None and os.path.isfile(os.path.join(path, naming.MANIFEST)):
        return path
    if tag is None:
        if not os.path.isdir(path):
            return None
        tag = read_latest(path)
        if tag is None:
            if any(os.path.isfile(os.path.join(path, e, naming.MANIFEST)) for e in os.listdir(path)
                   if not e.startswith(".")):
                raise CheckpointError(f"{os.path.join(path, naming.LATEST)}: missing, but {path} "
                                      "holds checkpoints; pass tag= (python -m zerompi.train: --resume_from TAG)")
            return None
        where = f"{os.path.join(path, naming.LATEST)} names {tag!r}, but"
    else:
        naming.check_tag(tag)
        where = "checkpoint"
    final = os.path.join(path, tag)
    if os.path.isdir(final):
        return final
    # Interrupted replacement of TAG: the previous TAG sits aside, complete.
    aside = [(s, p) for p in (os.path.join(path, e) for e in _listdir(path)
                              if e.startswith(f"{naming.OLD_PREFIX}{tag}-"))
             if (s := _created(p)) is not None]
    if aside:
        return max(aside)[1]
    raise CheckpointError(f"{where} {final} does not exist")


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []
