"""The one way a job prints a line: from one rank (rank 0 of the group that decides, or
a node's first rank), prefixed with the program's name, flushed; notices and errors to
stderr, information to stdout. Progress bars and metrics are trainer/progress.py's."""
from __future__ import annotations

import sys


def world_rank() -> int:
    """This process's rank in COMM_WORLD, 0 when MPI is not initialised (one process)."""
    MPI = sys.modules.get("mpi4py.MPI")
    try:
        if MPI is not None and MPI.Is_initialized() and not MPI.Is_finalized():
            return MPI.COMM_WORLD.Get_rank()
    except Exception:  # noqa: BLE001  (a half-torn-down MPI must not cost the message)
        pass
    return 0


def say(message: str, *, rank: int | None = None, prog: str = "zerompi", err: bool = True) -> None:
    """Print `prog: message` when `rank` (this process's rank in the group that decides;
    default: its COMM_WORLD rank) is 0."""
    if (world_rank() if rank is None else rank) != 0:
        return
    print(f"{prog}: {message}", file=sys.stderr if err else sys.stdout, flush=True)
