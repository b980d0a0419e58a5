"""Host buffers for the offloaded optimizer's staging: plain zeroed pages, page-locked
with cudaHostRegister when they feed a GPU.

Why not torch.empty(pin_memory=True): torch's pinned caching allocator rounds every
request up to a power of two (a 2.4 GB staging buffer takes 4 GiB of locked memory) and
is slower to allocate than registering ordinary pages (docs/performance.md, "Offload host
pass"). The pages registered are whole pages inside a
numpy allocation of our own (one page of slack on each side), so no other allocation
shares a registered page; the registration is undone when the last tensor viewing the
buffer is freed, before numpy frees the memory (numpy clears weak references first).
"""
from __future__ import annotations

import weakref

import numpy as np
import torch

PAGE = 4096


def _unregister(ptr: int) -> None:
    try:
        torch.cuda.cudart().cudaHostUnregister(ptr)
    except Exception:  # noqa: BLE001  (interpreter shutdown: the process is ending anyway)
        pass


def host_zeros(numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """A zeroed 1-D host tensor; `pin`: page-locked for asynchronous copies to and from
    the GPU (torch then sees it as pinned: `is_pinned()` is True)."""
    if not pin:
        return torch.zeros(numel, dtype=dtype)
    size = torch.empty(0, dtype=dtype).element_size()
    nbytes = max(PAGE, -(-numel * size // PAGE) * PAGE)
    raw = np.zeros(nbytes + 2 * PAGE, np.uint8)
    start = -raw.ctypes.data % PAGE
    ptr = raw.ctypes.data + start
    err = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed: {err}")
    weakref.finalize(raw, _unregister, ptr)
    return torch.from_numpy(raw[start:start + numel * size]).view(dtype)
