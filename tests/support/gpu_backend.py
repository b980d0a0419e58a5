"""What the GPU tests may ask of NCCL, decided by the engine's own check
(zerompi.comm.nccl.unavailable, which comm.create uses): a cupy that imports but cannot
load NCCL, or no visible GPU, makes an NCCL test skip with that reason instead of fail."""
from __future__ import annotations


def nccl_skip_reason() -> str | None:
    from zerompi.comm.nccl import unavailable

    why = unavailable("cuda")
    return None if why is None else f"NCCL cannot run here: {why}"
