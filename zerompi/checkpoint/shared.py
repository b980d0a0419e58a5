"""Does every node see the checkpoint directory? Checked once, at a job's first save.

Every rank writes its own file into the directory rank 0 created, so the directory must
be on a file system that all nodes mount (a cluster's parallel or network file system).
A node-local path (/tmp, a local scratch disk, a container's own overlay) looks fine on
every node and fails only at the first save, each node writing into its own copy: rank
0 would then publish a checkpoint whose rank files lie on other nodes' disks, or die
on a missing directory with a message about a file. Here the first save asks instead:

1. rank 0 has created the save's temporary directory (save_protocol.py) and every rank knows
   its name; the first rank of each node looks for it, waiting up to SEE_S for a
   network file system's directory cache, and if it sees it, writes a marker
   `.node-<i>` there;
2. rank 0 looks for every such marker, by name (again up to SEE_S);
3. the ranks agree on who saw what. If a node missed rank 0's directory or rank 0
   missed its marker, rank 0 removes the temporary directory (a node that saw nothing
   wrote nothing) and every rank raises RunDirNotShared with one message naming the
   nodes. Otherwise rank 0 removes the markers and the save goes on.

Single-node jobs skip it; each process checks each directory once.
"""
from __future__ import annotations

import os
import shutil
import time

from .. import runtime
from ..runtime.fileio import fsync_path

SEE_S = 3.0
_checked: set[str] = set()


class RunDirNotShared(runtime.JobError):
    """The checkpoint directory is not the same directory on every node."""

    exit_code = 2


def _missing(paths: list[str], seconds: float) -> list[str]:
    """Those of `paths` that have not appeared within `seconds` (all waited for at once).
    By exact name, a lookup rather than a listing: NFS revalidates a name on lookup."""
    t_end = time.monotonic() + seconds
    while True:
        paths = [p for p in paths if not os.path.exists(p)]
        if not paths or time.monotonic() > t_end:
            return paths
        time.sleep(0.1)


def _marker(tmp: str, node: int) -> str:
    return os.path.join(tmp, f".node-{node}")


def check_once(dims, directory: str, tmp: str) -> None:
    """Collective over dims.world, at the first save into `directory` (see above)."""
    nodes = getattr(dims, "nodes", None)
    if nodes is None or nodes.count < 2 or directory in _checked:
        return
    comm = dims.world
    saw = wrote = None
    if nodes.local_rank == 0:
        saw = not _missing([tmp], SEE_S)
        if saw and nodes.index != 0:
            try:
                with open(_marker(tmp, nodes.index), "w") as f:
                    f.write(nodes.name + "\n")
                    f.flush()
                    os.fsync(f.fileno())
                fsync_path(tmp)
                wrote = True
            except OSError:
                wrote = False
    everyone = comm.allgather_object((nodes.index, saw, wrote))  # sync: markers are written
    blind = sorted({i for i, s, _ in everyone if s is False})
    unseen = []
    if comm.rank == 0:
        writers = [i for i, s, w in everyone if s and w]
        gone = set(_missing([_marker(tmp, i) for i in writers], SEE_S))
        unseen = [i for i in writers if _marker(tmp, i) in gone] + [i for i, s, w in everyone if s and w is False]
    unseen = sorted(set(comm.bcast_object(unseen)))
    if not blind and not unseen:
        if comm.rank == 0:
            for i in range(1, nodes.count):
                try:
                    os.unlink(_marker(tmp, i))
                except FileNotFoundError:
                    pass
        _checked.add(directory)
        return
    if comm.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    comm.barrier()  # nobody raises before the temporary directory is gone
    raise RunDirNotShared(_message(nodes, directory, blind, unseen))


def _message(nodes, directory: str, blind: list[int], unseen: list[int]) -> str:
    def who(ids):
        return ", ".join(nodes.listing_of(i) for i in ids)

    parts = []
    if blind:
        parts.append(f"{who(blind)} cannot see the files that {who([0])} writes there")
    if unseen:
        parts.append(f"{who([0])} cannot see the files that {who(unseen)} write{'s' if len(unseen) == 1 else ''} there")
    return (f"checkpoint directory {directory} is not shared by the nodes: " + "; ".join(parts)
            + ". Every node must see the same run directory (--run_dir on a parallel or network file "
            "system, not a node-local disk); nothing was saved")
