"""One rank's HDF5 file, without torch: its structure, and its state written from a
host staging buffer (the asynchronous save's background writer, which may run in a
helper process that imports only numpy and h5py).

rankfile_engine.py writes the same file synchronously from the engine's own buffers;
both go through write_structure, so the two paths cannot drift apart. Layout: rankfile_engine.py's
docstring and docs/checkpoints.md.
"""
from __future__ import annotations

import bisect
import errno
import json
import mmap
import os
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import h5py
import numpy as np

from . import checksums, hdf5, naming

PIECE_DTYPE = np.dtype([("name", h5py.string_dtype()), ("shape", h5py.string_dtype()),
                        ("lo", "<i8"), ("hi", "<i8"), ("offset", "<i8")])
CHUNK = 8 << 20    # bytes per write: checked, checksummed and written while in cache
IN_FLIGHT = 2      # writes the helper thread may have queued behind the main thread
ALIGN = 4096       # O_DIRECT: file offsets, lengths and memory aligned to this
# The state datasets start on ALIGN boundaries (HDF5's H5Pset_alignment: a little
# padding, any HDF5 reader is unaffected) so that their bytes can go to disk with O_DIRECT.
H5_ALIGNMENT = {"alignment_threshold": 1 << 16, "alignment_interval": ALIGN}


def direct_io_enabled() -> bool:
    """O_DIRECT writes for the state (default on; ZEROMPI_CHECKPOINT_DIRECT_IO=0 turns
    them off). Writing through the page cache costs a fresh page per 4 KiB of checkpoint:
    on a VM each is a fault to the hypervisor, seconds of CPU per GB; O_DIRECT sends
    the bytes from a few reused, aligned buffers instead."""
    return hasattr(os, "O_DIRECT") and os.environ.get("ZEROMPI_CHECKPOINT_DIRECT_IO", "1") != "0"


def open_direct(path: str) -> int | None:
    """A second, O_DIRECT descriptor of `path`, or None where the filesystem refuses it
    (tmpfs, some FUSE) or direct I/O is off."""
    if not direct_io_enabled():
        return None
    try:
        return os.open(path, os.O_WRONLY | os.O_DIRECT)
    except OSError:
        return None


def pwrite_all(fd: int, data: memoryview, pos: int) -> None:
    while len(data):
        k = os.pwrite(fd, data, pos)
        data, pos = data[k:], pos + k


def aligned(nbytes: int) -> np.ndarray:
    """A page-aligned uint8 buffer (anonymous mmap), for O_DIRECT."""
    return np.frombuffer(mmap.mmap(-1, nbytes), dtype=np.uint8)


class Writer:
    """Checksums and writes byte arrays in file order on one helper thread (zlib and
    pwrite release the GIL), while the caller prepares the next ones. threaded=False
    does both in the caller's thread (the background writer: no second busy thread)."""

    def __init__(self, path: str, fd: int, dfd: int | None, threaded: bool = True):
        self.path, self.fd, self.dfd = path, fd, dfd
        self.crc = checksums.BlockCRC()
        self.pending: deque = deque()
        self.ex = ThreadPoolExecutor(1, thread_name_prefix="zerompi-ckpt-write") if threaded else None
        self.gap_buf = bytearray(1 << 20)

    def _submit(self, fn, *args):
        if self.ex is None:
            fn(*args)
            return None
        fut = self.ex.submit(fn, *args)
        self.pending.append(fut)
        while len(self.pending) > IN_FLIGHT:
            self.pending.popleft().result()
        return fut

    def gap(self, lo: int, hi: int) -> None:
        """Bytes HDF5 wrote (headers, piece table, RNG, module tensors): checksummed from the file."""
        if hi > lo:
            self._submit(checksums.crc_range, self.fd, lo, hi, self.crc, self.path, self.gap_buf)

    def put(self, data: np.ndarray, pos: int, direct: bool):
        """Checksum `data` (uint8) and write it at `pos`; returns a future (None when
        not threaded), done once `data` may be reused. direct: pos and data are
        ALIGN-aligned (a short tail goes through the page cache)."""
        return self._submit(self._write, data, pos, direct)

    def _write(self, data: np.ndarray, pos: int, direct: bool) -> None:
        self.crc.update(data)
        mv = memoryview(data).cast("B")
        if direct and self.dfd is not None:
            n = len(mv) // ALIGN * ALIGN
            try:
                pwrite_all(self.dfd, mv[:n], pos)
                mv, pos = mv[n:], pos + n
            except OSError as e:   # a filesystem that opens O_DIRECT files but refuses the writes
                if e.errno != errno.EINVAL:
                    raise
                os.close(self.dfd)
                self.dfd = None
        pwrite_all(self.fd, mv, pos)

    def finish(self) -> tuple[str, int]:
        while self.pending:
            self.pending.popleft().result()
        return self.crc.digest(), self.crc.size

    def seal(self, pos: int, size: int) -> str:
        """Checksum from `pos` to the end (`size`), make the file durable; its digest."""
        self.gap(pos, size)
        digest, done = self.finish()
        os.fsync(self.fd)
        if done != size:
            raise RuntimeError(f"{self.path}: checksummed {done} bytes of {size}")
        return digest

    def close(self) -> None:
        if self.ex is not None:
            self.ex.shutdown(wait=True, cancel_futures=True)
        if self.dfd is not None:
            os.close(self.dfd)


def alloc_raw(group, name: str, n: int, h5type) -> int | None:
    """A contiguous dataset of n elements allocated now and never filled (we write every
    byte ourselves); its byte offset in the file, or None when empty."""
    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
    dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
    dset = h5py.h5d.create(group.id, name.encode(), h5type, h5py.h5s.create_simple((n,)), dcpl=dcpl)
    return dset.get_offset() if n else None


def module_entry(name: str, shape, dtype: str, torch_dtype: str, role: str) -> dict:
    """The manifest's record of a frozen parameter or buffer stored with this shape and
    numpy dtype."""
    return {"shape": [int(d) for d in shape], "dtype": np.dtype(dtype).str, "torch_dtype": torch_dtype,
            "role": role, "link": naming.link_name(name)}


def write_structure(f, header: dict, module: list[tuple[str, np.ndarray, str, str]]) -> None:
    """Everything of a rank file but the state vectors. header: {"attrs": {...},
    "pieces": [(name, shape, lo, hi, offset)], "steps": JSON, "param_groups": JSON,
    "rng": {"torch", "numpy_keys" arrays; "numpy", "python" JSON}}; module (rank 0):
    (name, array, torch dtype name, 'frozen'|'buffer')."""
    f.attrs.update(header["attrs"])
    pieces = header["pieces"]
    table = np.array([(n, json.dumps(s), lo, hi, o) for n, s, lo, hi, o in pieces], dtype=PIECE_DTYPE)
    f.create_dataset("pieces", data=table, shape=(len(pieces),), dtype=PIECE_DTYPE)
    opt = f.create_group("optimizer")
    opt.attrs["steps"], opt.attrs["param_groups"] = header["steps"], header["param_groups"]
    rng = header["rng"]
    rg = f.create_group("rng")
    rg.create_dataset("torch", data=rng["torch"])
    rg.create_dataset("numpy_keys", data=rng["numpy_keys"])
    rg.attrs["numpy"], rg.attrs["python"] = rng["numpy"], rng["python"]
    if module:
        mg = f.create_group(naming.MODULE_GROUP)
        for name, arr, torch_dtype, role in module:
            d = mg.create_dataset(naming.link_name(name), data=arr, shape=arr.shape, dtype=arr.dtype)
            d.attrs.update({"name": name, "torch_dtype": torch_dtype, "role": role})


def check_room(path: str, need: int) -> None:
    """Refuse a rank file its filesystem cannot hold before HDF5 opens it: HDF5 failing to
    write while it closes a file leaves an object h5py cannot release, and the process can
    crash later (h5py issues 914, 2160) instead of reporting the full disk. Only a guard:
    other writers can still fill the disk meanwhile, and then our own pwrite reports it."""
    try:
        st = os.statvfs(os.path.dirname(path) or ".")
    except OSError:
        return
    free = st.f_bavail * st.f_frsize
    if free < need:
        raise OSError(errno.ENOSPC, f"No space left on device: {free} bytes free, the file needs about {need}", path)


def _diverged(kind: str, pieces: list, first: int) -> FloatingPointError:
    offsets = [p[4] for p in pieces]
    name = pieces[max(0, bisect.bisect_right(offsets, first) - 1)][0]
    # a diverged state must never replace (and then rotate away) a good one
    return FloatingPointError(f"refusing to checkpoint a diverged state: {kind} of {name} holds inf/nan")


def write_staged(path: str, job: dict, buf: np.ndarray) -> tuple[str, int]:
    """Write and fsync a rank file whose state and module tensors lie in `buf` (uint8,
    page-aligned), as background/snapshot.py laid them out; returns (digest, size) as
    checksums.digest_file computes them. job: {"header": write_structure's, "module":
    [(name, torch dtype, role, shape, numpy dtype, byte offset)], "datasets": [(kind,
    elements, byte offset, 'f4' | lowp kind)]}. State regions start page-aligned, so
    with O_DIRECT they go to disk straight from `buf`: no copy, one read for the
    inf/nan check and one for the checksum."""
    module = [(n, np.frombuffer(buf, np.dtype(dt), int(np.prod(shape)), off).reshape(shape), td, role)
              for n, td, role, shape, dt, off in job["module"]]
    plan = []
    check_room(path, buf.nbytes)
    with h5py.File(path, "w", libver=hdf5.LIBVER, locking=False, **H5_ALIGNMENT) as f:
        write_structure(f, job["header"], module)
        g = f.create_group(naming.STATE_GROUP)
        for kind, n, off, store in job["datasets"]:
            h5type = h5py.h5t.IEEE_F32LE if store == "f4" else hdf5.lowp_h5type(store)
            base = alloc_raw(g, kind, n, h5type)
            if base is not None:
                plan.append((base, kind, off, n * (4 if store == "f4" else 2), store == "f4"))
    plan.sort()
    pieces = job["header"]["pieces"]
    fd = os.open(path, os.O_RDWR)
    w = Writer(path, fd, open_direct(path), threaded=False)
    ok = np.empty(CHUNK // 4, dtype=bool)
    try:
        size, pos = os.fstat(fd).st_size, 0
        for base, kind, off, nbytes, checked in plan:
            w.gap(pos, base)
            for lo in range(0, nbytes, CHUNK):
                part = buf[off + lo:off + min(nbytes, lo + CHUNK)]
                if checked:
                    vals = part.view(np.float32)
                    np.isfinite(vals, out=ok[:vals.size])
                    if not ok[:vals.size].all():
                        raise _diverged(kind, pieces, lo // 4 + int(np.argmin(ok[:vals.size])))
                w.put(part, base + lo, base % ALIGN == 0)
            pos = base + nbytes
        digest = w.seal(pos, size)
    finally:
        w.close()
        os.close(fd)
    return digest, size
