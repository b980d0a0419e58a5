"""Device binding and CUDA-aware detection on N ranks of one node."""
import argparse
import json

from mpi4py import MPI

from zerompi import device, runtime

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
a = ap.parse_args()
w = MPI.COMM_WORLD
local, per_node = runtime.local_rank(w)
info = {"rank": w.rank, "local": local, "per_node": per_node, "device": str(device.bind(w)),
        "cuda_aware": device.cuda_aware_mpi(), "libs": device._loaded_mpi_libraries()}
allinfo = w.gather(info)
if w.rank == 0:
    json.dump(allinfo, open(a.out, "w"))
