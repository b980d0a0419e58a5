"""Rank 1 raises with a long traceback (a 40 kB message, more than one write) while the others wait in a collective; launched
WITHOUT `-m mpi4py`, so zerompi's abort hook must report and end the job."""
import sys
import time

import zerompi  # noqa: F401  (installs the abort hook)
from mpi4py import MPI

comm = MPI.COMM_WORLD
comm.Barrier()
if comm.rank == 0:
    print(f"all ranks up at {time.time():.3f}", flush=True)  # on stdout: the test reads stderr apart
print(f"rank {comm.rank} chatter " * 200, flush=True)  # stdout traffic competing with stderr


def dive(k: int):
    if k == 0:
        raise RuntimeError(f"rank one exploded on purpose ({sys.argv[1]}) " + "x" * 40_000 + " END")
    return dive(k - 1) + 1


if comm.rank == 1:
    dive(150)
comm.Barrier()  # the others block here until the abort ends them
