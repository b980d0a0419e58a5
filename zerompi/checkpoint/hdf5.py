"""HDF5 specifics: the file format bound, the bf16 type, and flat element ranges as
hyperslabs of full-shape datasets (no torch: inspect and verify import it)."""
from __future__ import annotations

import numpy as np

# HDF5's own file locks (flock) are off for every file we open: the save protocol never
# has a reader and a writer on one file, and flock fails on some parallel file systems
# (Lustre mounted without flock), which users otherwise meet as "unable to lock file".
# Upper bound on the HDF5 file format: files stay readable by HDF5 1.10 tools
# (Debian's h5ls/h5dump), although pip h5py ships a newer library.
LIBVER = ("earliest", "v110")


def bf16_type():
    """bfloat16 as a custom HDF5 float: 1 sign, 8 exponent (bias 127), 7 mantissa bits.
    h5dump prints its values and h5py reads it as float32 (HDF5 converts)."""
    import h5py

    t = h5py.h5t.IEEE_F32LE.copy()
    t.set_fields(15, 7, 8, 0, 7)   # sign pos, exponent pos/size, mantissa pos/size
    t.set_offset(0)
    t.set_precision(16)
    t.set_size(2)
    t.set_ebias(127)
    return t


def lowp_h5type(kind: str):
    import h5py

    return bf16_type() if kind == "param_bf16" else h5py.h5t.IEEE_F16LE.copy()



def flat_blocks(shape: tuple[int, ...], lo: int, hi: int) -> list[tuple[tuple, tuple]]:
    """Cut the row-major element range [lo, hi) of an array of `shape` into rectangular
    blocks (start, count), in flat order, each contiguous in row-major order. A piece of a
    parameter becomes at most 2*ndim-1 hyperslabs of the full-shape virtual dataset."""
    out: list[tuple[tuple, tuple]] = []

    def rec(dims: tuple[int, ...], lo: int, hi: int, prefix: tuple) -> None:
        if lo >= hi:
            return
        ones = (1,) * len(prefix)
        if len(dims) == 1:
            out.append((prefix + (lo,), ones + (hi - lo,)))
            return
        inner = int(np.prod(dims[1:]))
        i0, r0 = divmod(lo, inner)
        i1, r1 = divmod(hi, inner)
        if i0 == i1:
            rec(dims[1:], r0, r1, prefix + (i0,))
            return
        if r0:
            rec(dims[1:], r0, inner, prefix + (i0,))
            i0 += 1
        if i1 > i0:
            out.append((prefix + (i0,) + (0,) * (len(dims) - 1), ones + (i1 - i0,) + tuple(dims[1:])))
        if r1:
            rec(dims[1:], 0, r1, prefix + (i1,))

    rec(tuple(int(d) for d in shape) or (1,), int(lo), int(hi), ())
    return out
