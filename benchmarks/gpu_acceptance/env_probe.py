"""Step 1 of the GPU acceptance run (run.sh here): what this machine offers the GPU path, as JSON.

    python benchmarks/gpu_acceptance/env_probe.py OUT.json

GPU, driver, compute mode (nvidia-smi), torch and its CUDA (and whether torch.distributed
has NCCL and FSDP2), cupy, whether NCCL loads (and a one-rank NCCL communicator can be
made), the versions of packages the benchmarks use (DeepSpeed and its needs), whether
UntypedStorage._swap_data_ptr_ exists (stage 3's gather pool), MPI (the library
mpi4py loads, mpiexec, CUDA-awareness), nvcc/NVRTC, hostname resolution, and the
choices the acceptance script takes from them (`decide`: GPU present, e2e backend,
peak bf16 FLOP/s for MFU). Every part is guarded and the parts that can hang (MPI,
NCCL) run in child processes with a timeout: the file is always written.
"""
from __future__ import annotations

import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # this checkout's zerompi, not an installed one
    sys.path.insert(0, str(ROOT))

# dense bf16 FLOP/s per GPU by name (vendor datasheets), for MFU; 0 when unknown
PEAK_BF16 = [("H200", 989e12), ("H100 PCIe", 756e12), ("H100", 989e12), ("A100", 312e12)]
ENV_KEYS = ("CUDA_VISIBLE_DEVICES", "NCCL_SOCKET_IFNAME", "UCX_NET_DEVICES", "MPI4PY_LIBMPI",
            "LD_LIBRARY_PATH", "ZEROMPI_CUDA_AWARE_MPI")


def guarded(fn):
    try:
        return fn()
    except Exception as e:  # noqa: BLE001  a probe reports, it never stops
        return {"error": f"{type(e).__name__}: {e}"}


def run(cmd: list[str], timeout: float = 20) -> dict:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"error": f"{type(e).__name__}: {e}"}
    return {"rc": r.returncode, "out": r.stdout.strip()[-2000:], "err": r.stderr.strip()[-1000:]}


def child(code: str, timeout: float = 30) -> dict:
    """Run `code` in a fresh interpreter; it prints one JSON object."""
    r = run([sys.executable, "-c", code], timeout)
    if r.get("rc") == 0:
        try:
            return json.loads(r["out"].splitlines()[-1])
        except (ValueError, IndexError):
            pass
    return {"error": r.get("error") or r.get("err") or r.get("out")}


def host() -> dict:
    name = socket.gethostname()
    try:
        addr = socket.gethostbyname(name)
    except OSError as e:
        addr = f"unresolved: {e}"
    return {"hostname": name, "resolves_to": addr, "python": sys.version.split()[0],
            "platform": platform.platform(), "cpus": os.cpu_count(),
            "env": {k: os.environ[k] for k in ENV_KEYS if k in os.environ}}


def nvidia_smi() -> dict:
    if shutil.which("nvidia-smi") is None:
        return {"error": "nvidia-smi not found"}
    fields = "name,driver_version,compute_mode,memory.total,memory.used,pstate,power.limit"
    r = run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"])
    if r.get("rc") != 0:
        return r
    gpus = [dict(zip(fields.split(","), (v.strip() for v in line.split(",")))) for line in r["out"].splitlines()]
    return {"gpus": gpus, "cuda_driver": run(["nvidia-smi"]).get("out", "").split("CUDA Version:")[-1][:8].strip()}


def torch_info() -> dict:
    import torch

    d = {"version": torch.__version__, "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
         "swap_data_ptr": hasattr(torch.UntypedStorage, "_swap_data_ptr_"),
         "distributed": torch.distributed.is_available(),
         "nccl_backend": torch.distributed.is_available() and torch.distributed.is_nccl_available()}
    try:  # the e2e peer FSDP2
        from torch.distributed.fsdp import fully_shard  # noqa: F401
        d["fsdp2"] = True
    except ImportError as e:
        d["fsdp2"] = f"ImportError: {e}"
    if d["cuda_available"]:
        p = torch.cuda.get_device_properties(0)
        d.update(devices=torch.cuda.device_count(), name=p.name, capability=f"{p.major}.{p.minor}",
                 memory_bytes=p.total_memory, bf16=torch.cuda.is_bf16_supported(),
                 nccl=str(torch.cuda.nccl.version()) if hasattr(torch.cuda, "nccl") else None)
    return d


NCCL_CHILD = """
import json
d = {}
try:
    import cupy
    d["cupy"] = cupy.__version__
    d["cuda_runtime"] = cupy.cuda.runtime.runtimeGetVersion()
    d["cuda_driver"] = cupy.cuda.runtime.driverGetVersion()
    from cupy.cuda import nvrtc
    d["nvrtc"] = nvrtc.getVersion()
    from zerompi.comm.nccl import unavailable
    d["nccl_unavailable"] = unavailable("cuda")
    from cupy.cuda import nccl
    d["nccl_loads"] = bool(getattr(nccl, "available", True))
    if d["nccl_loads"]:
        d["nccl_version"] = nccl.get_version()
    if d["nccl_unavailable"] is None:
        nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
        d["nccl_comm_one_rank"] = True
except Exception as e:
    d["error"] = f"{type(e).__name__}: {e}"
print(json.dumps(d))
"""

MPI_CHILD = """
import json, os
d = {"MPI4PY_LIBMPI": os.environ.get("MPI4PY_LIBMPI")}
try:
    import mpi4py
    d["mpi4py"] = mpi4py.__version__
    from mpi4py import MPI
    d["library"] = MPI.Get_library_version().rstrip(chr(0)).splitlines()[0]  # Open MPI ends it with a NUL
    from zerompi.device import _loaded_mpi_libraries, cuda_aware_mpi
    d["loaded"] = _loaded_mpi_libraries()
    d["cuda_aware"] = cuda_aware_mpi()
except Exception as e:
    d["error"] = f"{type(e).__name__}: {e}"
print(json.dumps(d))
"""


def versions() -> dict:
    from importlib import metadata

    out = {}
    # deepspeed and what it needs that the GPU image may lack (gpu_acceptance.sh's peers step)
    for name in ("numpy", "h5py", "transformers", "pytest", "pytest-xdist", "pytest-timeout", "mpich",
                 "nvidia-nccl-cu12", "nvidia-nccl-cu13", "deepspeed", "pydantic", "typing_extensions", "hjson"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def decide(p: dict) -> dict:
    t, n = p.get("torch") or {}, p.get("cupy_nccl") or {}
    gpu = bool(t.get("cuda_available"))
    name = t.get("name", "")
    peak = next((v for k, v in PEAK_BF16 if k in name), 0.0)
    return {"gpu": gpu, "e2e_backend": "auto" if gpu and n.get("nccl_unavailable", "x") is None else "mpi",
            "peak_bf16_flops": peak, "mpi_works": "library" in p.get("mpi", {}),
            "mpiexec": shutil.which("mpiexec")}


def main(argv: list[str]) -> int:
    t0, out = time.time(), Path(argv[0])
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    p = {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    # cheap parts first, NCCL (which can hang in its set-up) last: within the step's
    # 45 s cap even when NCCL times out
    parts = [("host", lambda: guarded(host)), ("nvidia_smi", lambda: guarded(nvidia_smi)),
             ("torch", lambda: guarded(torch_info)), ("mpi", lambda: child(MPI_CHILD, 20)),
             ("nvcc", lambda: run(["nvcc", "--version"]).get("out", "not found").splitlines()[-1:]),
             ("versions", lambda: guarded(versions)),
             # "-dirty": the files that ran differ from that commit (a device copy of a working tree)
             ("zerompi_commit", lambda: run(["git", "-C", str(ROOT), "describe", "--always", "--dirty",
                                             "--abbrev=40"]).get("out")),
             # gpu_acceptance.sh --commit: what the caller says the tree holds
             ("zerompi_commit_given", lambda: os.environ.get("ZEROMPI_COMMIT")),
             ("cupy_nccl", lambda: child(NCCL_CHILD, 25))]
    for key, fn in parts:
        p[key] = fn()
        p["decide"] = decide(p)
        p["probe_seconds"] = round(time.time() - t0, 1)
        out.write_text(json.dumps(p, indent=1))  # part by part: a probe cut off keeps what it found
    d, t, n = p["decide"], p["torch"] or {}, p["cupy_nccl"] or {}
    nccl = n.get("nccl_unavailable", n.get("error", "?")) or "usable"
    print(f"probe: GPU {t.get('name', 'none')} | torch {t.get('version')} CUDA {t.get('cuda')} | "
          f"cupy {n.get('cupy')} NCCL {n.get('nccl_version')} ({nccl}) | "
          f"MPI {p['mpi'].get('library', p['mpi'].get('error'))} | "
          f"hostname -> {p['host'].get('resolves_to')} | e2e backend {d['e2e_backend']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
