"""Where memory lives (Placement), which device a rank computes on, and whether MPI can
take GPU buffers directly.

- Placement: every buffer of model state (shards, flat parameters, gradients, buckets,
  gathered stage-3 units) is allocated through one, so moving the state to a GPU or
  offloading it to the host is a different Placement, not an edit of every allocation.

- Binding: each rank takes GPU (node-local rank mod visible GPUs). The node-local rank
  comes from an MPI shared-memory split, which works the same under mpiexec and srun
  (no launcher-specific environment variables needed).
- CUDA-aware MPI: asked at run time through MPIX_Query_cuda_support (MPICH, Open MPI
  and MVAPICH export it; mpi4py has no wrapper, so it is called through ctypes on the
  MPI library mpi4py loaded). pip's MPICH answers 0: GPU buffers must then be staged
  through host memory, or go through NCCL. ZEROMPI_CUDA_AWARE_MPI=0/1 overrides it.
"""
from __future__ import annotations

import ctypes
import mmap
import os
from dataclasses import dataclass
from functools import lru_cache

import torch

from . import runtime
from .runtime import watchdog


@dataclass(frozen=True)
class Placement:
    """Where a buffer lives: host memory or one CUDA device. `pinned` host memory is
    page-locked, for buffers that feed host<->device copies (offloaded optimizer state,
    host-staged MPI); it needs a CUDA build of torch with a visible GPU."""

    device: torch.device = torch.device("cpu")
    pinned: bool = False

    def __post_init__(self) -> None:
        if self.pinned and self.device.type != "cpu":
            raise ValueError(f"placement {self.device}: only host memory can be pinned")

    @classmethod
    def of(cls, device: "torch.device | str", pinned: bool = False) -> "Placement":
        return cls(torch.device(device), pinned)

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        if self.pinned:
            return torch.empty(numel, dtype=dtype, pin_memory=True)
        return torch.empty(numel, dtype=dtype, device=self.device)

    def zeros(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return self.empty(numel, dtype).zero_()

    def host_staging(self, nbytes: int) -> tuple[torch.Tensor, int | None]:
        """A page-aligned host byte buffer to snapshot this placement's tensors into
        (asynchronous checkpoints), meant to be allocated once and reused: backed by a
        memfd where Linux has one, so a helper process can map it too (the descriptor
        is returned, else None), and page-locked when this placement is a GPU's, so
        device-to-host copies into it run asynchronously at full speed."""
        nbytes = max(1, int(nbytes))
        fd = os.memfd_create("zerompi-staging", getattr(os, "MFD_CLOEXEC", 0)) if hasattr(os, "memfd_create") else None
        if fd is not None:
            os.ftruncate(fd, nbytes)
        mem = mmap.mmap(fd if fd is not None else -1, nbytes)
        t = torch.frombuffer(mem, dtype=torch.uint8)  # keeps `mem` alive
        if self.is_cuda:
            # cudaHostRegister (torch's helper): the pinned allocator cannot take memory
            # mapped elsewhere. Unverified on a GPU in this repository's tests.
            from torch.cuda._pin_memory_utils import pin_memory

            pin_memory(t.data_ptr(), nbytes)
        return t, fd

    def __str__(self) -> str:
        return "host (pinned)" if self.pinned else ("host" if self.device.type == "cpu" else str(self.device))


def _loaded_mpi_libraries() -> list[str]:
    """Paths of MPI shared libraries mapped into this process."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "/" in line}
    except OSError:
        return []
    return sorted(p for p in paths if os.path.basename(p).startswith(("libmpi", "libmpich")))


@lru_cache(maxsize=1)
def cuda_aware_mpi() -> bool:
    """True when the MPI library accepts device pointers (asked once per process)."""
    env = os.environ.get("ZEROMPI_CUDA_AWARE_MPI")
    if env is not None:
        if env not in ("0", "1"):
            raise ValueError(f"ZEROMPI_CUDA_AWARE_MPI = {env!r}: must be 0 or 1")
        return env == "1"
    runtime.mpi()  # make sure the library is loaded
    for path in _loaded_mpi_libraries():
        try:
            fn = getattr(ctypes.CDLL(path), "MPIX_Query_cuda_support")
        except (OSError, AttributeError):
            continue
        fn.restype = ctypes.c_int
        return bool(fn())
    return False


def bind(comm) -> torch.device:
    """This rank's compute device: cuda:(local rank mod GPUs) when GPUs exist, else cpu.
    `comm` is an mpi4py communicator spanning the job."""
    local, _ = local_rank(comm)
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n == 0:
        return torch.device("cpu")
    dev = torch.device("cuda", local % n)
    torch.cuda.set_device(dev)
    return dev


def local_rank(comm) -> tuple[int, int]:
    """(node-local rank, ranks on this node) from an MPI shared-memory split."""
    MPI = runtime.mpi()
    with watchdog.waiting("split_type"):
        node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    try:
        return node.Get_rank(), node.Get_size()
    finally:
        node.Free()
