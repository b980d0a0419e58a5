"""A torch CUDA stream as a CuPy stream, so CuPy kernels run in torch's stream order.

CuPy 14 deprecates `cupy.cuda.ExternalStream(ptr, device)` (a DeprecationWarning at
every construction, i.e. twice per training step) in favour of
`cupy.cuda.Stream.from_external(obj)`, which takes any object with `__cuda_stream__`
(the CUDA stream protocol) and keeps a reference to it. Not every torch release has
that method, so the protocol is given by a small wrapper of our own. CuPy <= 13 has
only ExternalStream.
"""
from __future__ import annotations

from typing import Any


class _TorchStream:
    """The CUDA stream protocol over a torch stream (holds it: CuPy keeps this object
    as the stream's owner reference, and a Stream without one is destroyed by CuPy)."""

    def __init__(self, stream: Any):
        self.stream = stream

    def __cuda_stream__(self) -> tuple[int, int]:
        return 0, int(self.stream.cuda_stream)


def cupy_stream(cupy: Any, stream: Any, device_id: int) -> Any:
    """A CuPy stream on the same CUDA stream as torch `stream` (of device `device_id`)."""
    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is not None:
        return from_external(_TorchStream(stream))
    return cupy.cuda.ExternalStream(int(stream.cuda_stream), device_id)


__all__ = ["cupy_stream"]
