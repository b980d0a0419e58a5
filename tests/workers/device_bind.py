"""Device binding and CUDA-aware detection on N ranks of one node.

Per rank: node-local rank and ranks per node, the bound device, the MPI libraries
device.py found, and three views of CUDA-awareness:
  as_launched  device.cuda_aware_mpi() with the environment the job was started with
               ({"value": bool} or {"error": class name, "message": ...});
  detected     the same with ZEROMPI_CUDA_AWARE_MPI removed (the cache cleared), i.e.
               what run-time detection alone answers;
  queried      MPIX_Query_cuda_support of the MPI library, called here independently of
               device.py: through the mpi4py extension module's own handle (dlsym
               searches the libraries it is linked against) rather than device.py's
               /proc/self/maps scan; None when that library has no such function.
"""
import argparse
import ctypes
import json
import os

from mpi4py import MPI

from zerompi import device, runtime

VAR = "ZEROMPI_CUDA_AWARE_MPI"

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
a = ap.parse_args()
w = MPI.COMM_WORLD


def ask() -> dict:
    device.cuda_aware_mpi.cache_clear()
    try:
        return {"value": device.cuda_aware_mpi()}
    except Exception as e:  # recorded for the test to judge
        return {"error": type(e).__name__, "message": str(e)}


def query() -> int | None:
    try:
        fn = ctypes.CDLL(MPI.__file__).MPIX_Query_cuda_support
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_int
    return int(fn())


as_launched = ask()
launched_env = os.environ.pop(VAR, None)
detected = ask()
if launched_env is not None:
    os.environ[VAR] = launched_env
device.cuda_aware_mpi.cache_clear()

local, per_node = device.local_rank(w)
info = {"rank": w.rank, "local": local, "per_node": per_node, "device": str(device.bind(w)),
        "libs": device._loaded_mpi_libraries(), "as_launched": as_launched, "detected": detected,
        "queried": query()}
allinfo = w.gather(info)
if w.rank == 0:
    with open(a.out, "w") as f:
        json.dump(allinfo, f)
