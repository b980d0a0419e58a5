"""The checkpoint's fast paths (issue 16): block checksums that parallel threads compute
identically and that catch a flipped byte, legacy sha256 entries still checked, and a
save that streams the engine's own buffers (no concatenated copy of the shard)."""
import hashlib
import sys
import os

import h5py
import numpy as np
import pytest
import torch

from zerompi.checkpoint import checksums, manifest_json, naming


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(checksums, "_DIGEST_BLOCK", 1 << 20)


def test_block_checksum_is_thread_count_independent_and_catches_a_flip(tmp_path, small_blocks):
    p = tmp_path / "f.bin"
    data = bytearray(os.urandom((5 << 20) + 12345))  # 6 blocks, the last one short
    p.write_bytes(data)
    one, size = checksums.digest_file(str(p), threads=1)
    assert size == len(data) and one.startswith("crc32/64MiB:") and len(one.split(":")[1]) == 6 * 8
    assert checksums.digest_file(str(p), threads=4)[0] == one
    data[3 << 20] ^= 0x01
    p.write_bytes(data)
    assert checksums.digest_file(str(p), threads=2)[0] != one
    ok, algo = checksums.file_matches(str(p), {"digest": one})
    assert not ok and algo == "crc32"


def test_legacy_sha256_entries_are_still_verified(tmp_path):
    p = tmp_path / "f.bin"
    p.write_bytes(b"zerompi" * 1000)
    good = {"sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
    assert checksums.file_matches(str(p), good) == (True, "sha256")
    assert checksums.file_matches(str(p), {"sha256": "0" * 64}) == (False, "sha256")


def test_save_streams_views_of_the_engine_buffers():
    import zerompi

    torch.manual_seed(0)
    eng = zerompi.initialize(torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3)),
                             {"stage": 2, "precision": "bf16", "bucket_size": 16})
    st = eng.export_state(views=True)
    storages = {t.untyped_storage().data_ptr() for t in eng.state.buffers().values()}
    for kind, pieces in st["tensors"].items():
        assert pieces and all(t.untyped_storage().data_ptr() in storages for t in pieces), kind
    cat = eng.export_state()["tensors"]
    for kind, pieces in st["tensors"].items():
        assert torch.equal(torch.cat(pieces), cat[kind])


def test_block_crc_of_a_stream_equals_the_file_digest(tmp_path, small_blocks):
    data = os.urandom((3 << 20) + 777)
    p = tmp_path / "f.bin"
    p.write_bytes(data)
    c, pos = checksums.BlockCRC(), 0
    for k in (1, 5000, 1 << 20, 3, (1 << 20) + 11, len(data)):  # pieces across block edges
        c.update(data[pos:pos + k])
        pos += k
    assert c.size == len(data) and c.digest() == checksums.digest_file(str(p))[0]


@pytest.mark.parametrize("direct", ["1", "0"])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_digest_computed_while_writing_matches_the_file(tmp_path, monkeypatch, small_blocks, precision, direct):
    """The writer checksums from memory, chunk by chunk, HDF5's own bytes from the file:
    the result must be digest_file's, with chunks and blocks smaller than the datasets,
    through O_DIRECT and aligned buffers or through the page cache."""
    import json

    import zerompi
    from zerompi.checkpoint import save, verify_checkpoint
    from zerompi.checkpoint import rankfile_engine as writer

    monkeypatch.setattr(writer, "_CHUNK", 4096)
    monkeypatch.setenv("ZEROMPI_CHECKPOINT_DIRECT_IO", direct)
    torch.manual_seed(0)
    eng = zerompi.initialize(torch.nn.Sequential(torch.nn.Linear(300, 500), torch.nn.Linear(500, 700)),
                             {"stage": 2, "precision": precision})
    path = save(eng, tmp_path, tag="t")
    m = json.loads((tmp_path / "t" / "manifest.json").read_text())
    assert m["format_version"] == naming.VERSION == 2
    for name, info in m["files"].items():
        digest, size = checksums.digest_file(os.path.join(path, name))
        assert (digest, size) == (info["digest"], info["size"]) and len(digest.split(":")[1]) > 8, name
    verify_checkpoint(path)
    with h5py.File(os.path.join(path, naming.rank_file(0)), "r") as f:   # the values, as written
        for kind, t in eng.export_state()["tensors"].items():
            assert np.array_equal(f[f"state/{kind}"][()], t.numpy()), kind
        if precision != "fp32":
            lowp = naming.lowp_kind(precision)
            want = eng.export_state()["tensors"]["param"].to(torch.bfloat16 if precision == "bf16" else torch.float16)
            assert np.array_equal(f[f"state/{lowp}"][()], want.float().numpy())


def test_diverged_state_is_refused_naming_the_tensor(tmp_path, monkeypatch):
    import zerompi
    from zerompi.checkpoint import CheckpointError, save
    from zerompi.checkpoint import rankfile_engine as writer

    monkeypatch.setattr(writer, "_CHUNK", 4096)
    torch.manual_seed(0)
    eng = zerompi.initialize(torch.nn.Sequential(torch.nn.Linear(40, 50), torch.nn.Linear(50, 60)),
                             {"stage": 2, "precision": "fp32"})
    save(eng, tmp_path, tag="good")
    st = eng.export_state(views=True)
    names = [p[0] for p in st["pieces"]]
    j = names.index("1.weight")
    st["tensors"]["exp_avg"][j].view(-1)[-1] = float("nan")
    with pytest.raises(CheckpointError, match="diverged state: exp_avg of 1.weight"):
        save(eng, tmp_path, tag="bad")
    assert sorted(os.listdir(tmp_path)) == ["good", "latest"]  # nothing left of the refused save


def test_version_1_manifests_with_digest_entries_still_verify(tmp_path):
    """Checkpoints written after the switch to CRC-32 blocks but before the version bump
    say format_version 1 and carry "digest"; a future version is refused by number."""
    import json

    import zerompi
    from zerompi.checkpoint import CheckpointError, save, verify_checkpoint

    torch.manual_seed(0)
    eng = zerompi.initialize(torch.nn.Linear(20, 30), {"stage": 2, "precision": "fp32"})
    path = save(eng, tmp_path, tag="t")
    mpath = os.path.join(path, naming.MANIFEST)
    m = json.loads(open(mpath).read())
    for version, ok in ((1, True), (3, False)):
        with open(mpath, "w") as f:
            f.write(json.dumps(manifest_json.seal(dict(m, format_version=version))))
        if ok:
            assert verify_checkpoint(path)["format_version"] == 1
        else:
            with pytest.raises(CheckpointError, match="format version 3, this zerompi reads versions 1, 2"):
                verify_checkpoint(path)


def test_cleanup_removes_a_dead_writers_latest_temporary_at_once(tmp_path):
    """A SIGKILL inside write_latest leaves .latest.HOST-PID.XXXX.tmp: the next good save's
    cleanup removes it when that pid is dead on this host, and keeps a live writer's."""
    import socket
    import subprocess

    from zerompi.checkpoint import directory

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = socket.gethostname()
    (tmp_path / f".latest.{host}-{dead.pid}.abcd1234.tmp").write_text("step_1\n")
    live = tmp_path / f".latest.{host}-{os.getpid()}.efgh5678.tmp"
    live.write_text("step_2\n")
    directory.cleanup(str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == [live.name]
