"""The checkpoint's fast paths (issue 16): block checksums that parallel threads compute
identically and that catch a flipped byte, legacy sha256 entries still checked, and a
save that streams the engine's own buffers (no concatenated copy of the shard)."""
import hashlib
import os

import pytest
import torch

from zerompi.checkpoint import format as fmt


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(fmt, "_DIGEST_BLOCK", 1 << 20)


def test_block_checksum_is_thread_count_independent_and_catches_a_flip(tmp_path, small_blocks):
    p = tmp_path / "f.bin"
    data = bytearray(os.urandom((5 << 20) + 12345))  # 6 blocks, the last one short
    p.write_bytes(data)
    one, size = fmt.digest_file(str(p), threads=1)
    assert size == len(data) and one.startswith("crc32/64MiB:") and len(one.split(":")[1]) == 6 * 8
    assert fmt.digest_file(str(p), threads=4)[0] == one
    data[3 << 20] ^= 0x01
    p.write_bytes(data)
    assert fmt.digest_file(str(p), threads=2)[0] != one
    ok, algo = fmt.file_matches(str(p), {"digest": one})
    assert not ok and algo == "crc32"


def test_legacy_sha256_entries_are_still_verified(tmp_path):
    p = tmp_path / "f.bin"
    p.write_bytes(b"zerompi" * 1000)
    good = {"sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
    assert fmt.file_matches(str(p), good) == (True, "sha256")
    assert fmt.file_matches(str(p), {"sha256": "0" * 64}) == (False, "sha256")


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
