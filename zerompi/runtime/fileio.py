"""One way to write a file so that a crash never leaves a half-written one in its place.

The data goes to a temporary file in the destination's directory (so the final rename
stays on one filesystem and is atomic), is fsynced, renamed over the destination, and
the directory is fsynced so the rename itself survives a power loss.
"""
from __future__ import annotations

import os
import socket
import tempfile
from contextlib import contextmanager
from typing import IO, Iterator


def fsync_path(path: str | os.PathLike) -> None:
    """fsync a file or directory (a rename is durable only once its directory is synced)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_file(dest: str | os.PathLike, mode: str = "wb") -> Iterator[IO]:
    """`with atomic_file(path) as f: f.write(...)`: `path` holds either its old content
    or everything written here, never a part. On an exception the temporary is removed.
    `f.name` is the temporary's path, for writers that need a file name."""
    dest = os.fspath(dest)
    folder = os.path.dirname(os.path.abspath(dest))
    # host-pid in the name: a later cleanup can tell a crashed writer's leftover from a live one's
    owner = f"{socket.gethostname()}-{os.getpid()}"
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(dest)}.{owner}.", suffix=".tmp")
    try:
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, dest)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_path(folder)


def atomic_write(dest: str | os.PathLike, data: bytes | str) -> None:
    """Replace `dest` with `data` atomically and durably."""
    with atomic_file(dest, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
