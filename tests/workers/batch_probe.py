"""A case for the batch machinery's own tests (tests/multirank/test_batch.py).

--mode ok: rank 0 writes its pid; raise-all: every rank raises after a barrier; raise-one:
rank 1 raises while the others wait in a barrier (the launch must end); hang: every rank
sleeps longer than any test waits; exit: sys.exit(0) before writing (a success that wrote
nothing)."""
import argparse
import json
import os
import sys
import time

from mpi4py import MPI

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("--mode", required=True)
ap.add_argument("--tag", default="")
a = ap.parse_args()
w = MPI.COMM_WORLD
if a.mode == "raise-all":
    w.Barrier()
    raise RuntimeError(f"probe raised on rank {w.rank}")
if a.mode == "raise-one":
    if w.rank == 1:
        raise RuntimeError("probe raised on rank 1 only")
    w.Barrier()
if a.mode == "hang":
    time.sleep(3600)
if a.mode == "exit":
    sys.exit(0)
if w.rank == 0:
    with open(a.out, "w") as f:
        json.dump({"pid": os.getpid(), "tag": a.tag, "env": os.environ.get("PROBE_ENV")}, f)
