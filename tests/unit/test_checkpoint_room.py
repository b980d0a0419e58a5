"""A rank file its filesystem cannot hold is refused before HDF5 opens it
(checkpoint/rankfile_h5.check_room): HDF5 failing inside a file's close leaves an object
h5py cannot release, and the process could crash later instead of reporting the full
disk. One rank, in-process; the free space is what os.statvfs says (patched). The
background writer runs in a helper process (patches do not reach it): its function is
called here directly. The full
disk for real, 2 ranks: tests/system/test_reliability.py::test_disk_full_during_save_leaves_nothing_behind."""
import os

import h5py
import pytest
import torch

import zerompi
from zerompi.checkpoint import CheckpointError
from zerompi.models.gpt import GPT, PRESETS


def test_a_full_disk_is_reported_before_hdf5_writes(tmp_path, monkeypatch):
    torch.manual_seed(0)
    engine = zerompi.initialize(GPT(PRESETS["tiny"]), {"stage": 2, "optimizer": {"lr": 1e-2}})
    x = torch.randint(0, 256, (2, 16))
    _, loss = engine(x, x)
    engine.backward(loss)
    engine.step()
    real, full = os.statvfs, str(tmp_path / "full")

    def statvfs(path):
        st = real(path)
        if not os.fspath(path).startswith(full):
            return st
        return os.statvfs_result((st.f_bsize, 4096, st.f_blocks, 0, 16, *st[5:]))  # 64 KiB left

    opened = []
    h5_file = h5py.File

    def spy(name, *a, **kw):
        opened.append(os.fspath(name))
        return h5_file(name, *a, **kw)

    monkeypatch.setattr(os, "statvfs", statvfs)
    monkeypatch.setattr(h5py, "File", spy)
    with pytest.raises(CheckpointError) as e:
        engine.save_checkpoint(full, tag="t")
    msg = str(e.value)
    assert "rank-0000" in msg and "out of space" in msg and "needs about" in msg and "0.1 MiB free there now" in msg, msg
    assert not [p for p in opened if "rank-" in p], opened  # HDF5 never opened the rank file
    assert not (tmp_path / "full" / "t").exists()
    engine.save_checkpoint(tmp_path / "room", tag="t")  # with room: saved


def test_the_background_writer_checks_too(tmp_path, monkeypatch):
    """write_staged (the background writer's, in its helper process) refuses first too."""
    from zerompi.checkpoint import rankfile_h5

    monkeypatch.setattr(os, "statvfs", lambda p: os.statvfs_result((4096, 4096, 1 << 20, 0, 1, 0, 0, 0, 0, 255)))
    monkeypatch.setattr(h5py, "File", lambda *a, **kw: pytest.fail("HDF5 opened the file"))
    with pytest.raises(OSError) as e:
        rankfile_h5.write_staged(str(tmp_path / "rank-0000.h5"), {"module": []}, rankfile_h5.aligned(1 << 16))
    assert e.value.errno == 28 and "4096 bytes free, the file needs about 65536" in str(e.value)
