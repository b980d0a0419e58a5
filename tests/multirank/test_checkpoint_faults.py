"""Checkpoints under faults: damaged or half-replaced checkpoints failing on every rank
with the file named, and rotation that touches nothing but checkpoints. SIGKILL in the
middle of saves: tests/system/test_checkpoint_crash.py. Shared jobs: checkpoint_cases.py."""
import json
import os
import shutil
import subprocess
import sys

import h5py
import pytest

from checkpoint_cases import train_job
from mpirun import ROOT, WORKERS, run_mpi
from zerompi.checkpoint import CheckpointError, verify_checkpoint
from zerompi.checkpoint import manifest_json, naming
from zerompi.checkpoint.directory import resolve, rotate, write_latest


# ---------------------------------------------------------------------------- damaged checkpoints
def _corrupt(ckpt_base, tmp_path):
    """Damaged copies of the N=2 stage-2 odd-model checkpoint (step-3 inside DIR)."""
    good = ckpt_base["dir"] / "s2"
    cases = {}

    def copy(name):
        dst = tmp_path / name
        shutil.copytree(good, dst)
        return dst, dst / "step-3"

    d, c = copy("truncated")
    with open(c / "rank-00001.h5", "r+b") as f:
        f.truncate(os.path.getsize(c / "rank-00001.h5") // 2)
    cases["truncated"] = (d, "rank-00001.h5")
    d, c = copy("missing")
    os.unlink(c / "rank-00000.h5")
    cases["missing"] = (d, "rank-00000.h5")
    d, c = copy("flipped")
    with h5py.File(c / "rank-00001.h5", "r") as f:  # inside the fp32 data: HDF5 cannot notice
        off = f["state/exp_avg"].id.get_offset() + 17
    with open(c / "rank-00001.h5", "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0x40]))
    cases["flipped"] = (d, "rank-00001.h5")
    d, c = copy("noindex")
    os.unlink(c / "index.h5")
    cases["noindex"] = (d, "index.h5")
    d, c = copy("garbage-latest")
    (d / "latest").write_bytes(b"\x00\xff garbage\n")
    cases["garbage-latest"] = (d, "latest")
    d, c = copy("bad-manifest")
    text = (c / "manifest.json").read_bytes()
    (c / "manifest.json").write_bytes(text.replace(b'"stage": 2', b'"stage": 1'))
    cases["bad-manifest"] = (d, "manifest.json")
    cases["other-model"] = (ckpt_base["dir"] / "bf16", "wte.weight")
    return cases


def test_damaged_checkpoints_fail_on_every_rank(ckpt_base, tmp_path):
    """Each damage gives CheckpointError on all 3 ranks, naming the file (or tensor):
    never zeros from a missing VDS source, never a rank left waiting."""
    cases = _corrupt(ckpt_base, tmp_path)
    runs = [{"model": "odd", "stage": 2, "plan": [["load_error", str(d), None] for d, _ in cases.values()]
             + [["load", str(ckpt_base["dir"] / "s2"), None]]}]  # and the engine still loads a good one
    res = train_job(3, runs, tmp_path, "damaged", timeout=120)
    assert len(res["runs"][0]) == len(cases) + 1
    assert res["runs"][0][-1]["global_steps"] == 3, res["runs"][0][-1]  # the good one loaded
    for (case, (_, needle)), out in zip(cases.items(), res["runs"][0]):
        errors = out["errors"]
        assert len(errors) == 3 and all(e is not None for e in errors), (case, errors)
        assert all(needle in e for e in errors), (case, errors)
    msgs = {case: out["errors"][0] for case, out in zip(cases, res["runs"][0])}
    assert "checksum (crc32) mismatch" in msgs["flipped"] and "holds" in msgs["flipped"]
    assert "truncated" in msgs["truncated"] and "missing" in msgs["missing"]
    assert "another model" in msgs["other-model"]
    # inspect --verify: exit status 1 and the file named, for every case
    for case, (d, needle) in cases.items():
        if case == "other-model":
            continue
        p = subprocess.run([sys.executable, "-m", "zerompi.inspect", str(d), "--verify"], cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
        assert p.returncode == 1 and needle in p.stderr, (case, p.returncode, p.stderr)


def test_damaged_checkpoint_uncaught_ends_the_job(ckpt_base, tmp_path):
    """Uncaught, the error ends the whole mpiexec job with a non-zero exit (no hang)."""
    d = _corrupt(ckpt_base, tmp_path)["flipped"][0]
    runs = [{"model": "odd", "stage": 1, "plan": [["load", str(d), None]]}]
    (tmp_path / "plan.json").write_text(json.dumps(runs))
    res = run_mpi(3, [str(WORKERS / "ckpt_train.py"), "--out", str(tmp_path / "o.json"),
                      "--runs", str(tmp_path / "plan.json")], timeout=90, check=False)
    assert res.returncode != 0
    assert "CheckpointError" in res.stdout and "rank-00001.h5: checksum (crc32) mismatch" in res.stdout, res.stdout[-3000:]


def test_interrupted_replacement_falls_back(ckpt_base, tmp_path):
    """Saving over an existing tag moves the old one aside first; a crash between the
    two renames leaves latest -> TAG absent: lookup uses the intact .old-TAG-*."""
    d = tmp_path / "ck"
    shutil.copytree(ckpt_base["dir"] / "s2", d)
    os.rename(d / "step-3", d / ".old-step-3-abcd")
    assert resolve(d) == str(d / ".old-step-3-abcd")
    verify_checkpoint(d)
    shutil.rmtree(d / ".old-step-3-abcd")
    with pytest.raises(CheckpointError, match="latest names 'step-3'"):
        resolve(d)
    assert resolve(tmp_path / "nothing-here") is None


def test_rotation_only_touches_checkpoints(ckpt_base, tmp_path):
    d = tmp_path / "ck"
    for t in ("a", "b", "c"):
        shutil.copytree(ckpt_base["dir"] / "s1" / "step-3", d / t)
        m = json.loads((d / t / "manifest.json").read_text())
        m["created_ns"] = {"a": 1, "b": 2, "c": 3}[t]
        (d / t / "manifest.json").write_text(json.dumps(manifest_json.seal(m)))
    (d / "notes").mkdir()
    write_latest(str(d), "c")
    assert rotate(str(d), 1, "c") == ["a", "b"]
    assert sorted(os.listdir(d)) == ["c", "latest", "notes"]


def test_missing_manifest_is_damage_and_resume_falls_back(tmp_path, capfd):
    """A checkpoint directory without manifest.json (a half-copied or damaged one) is
    skipped with the usual damage warning, and the run resumes from the newest one that
    verifies: not "rank 0 cannot see checkpoint ..." (a filesystem diagnosis, no fall-back)."""
    import torch

    import zerompi
    from zerompi.checkpoint.resume import ResumeError, resume

    torch.manual_seed(0)
    eng = zerompi.initialize(torch.nn.Linear(8, 4), {"stage": 1})
    for step in (1, 2):
        eng.save_checkpoint(tmp_path, tag=f"step_{step:07d}", client_state={"step": step})
    os.unlink(tmp_path / "step_0000002" / naming.MANIFEST)
    client = resume(eng, eng.dims.world, tmp_path)
    err = capfd.readouterr().err
    assert client == {"step": 1}, err
    assert f"WARNING: checkpoint {tmp_path / 'step_0000002'} is damaged and is skipped" in err, err
    assert "manifest.json: missing" in err and "cannot see" not in err, err
    assert f"RESUMING FROM AN OLDER CHECKPOINT, {tmp_path / 'step_0000001'}" in err, err
    with pytest.raises(ResumeError, match="--resume_from step_0000002: .*manifest.json: missing"):
        resume(eng, eng.dims.world, tmp_path, resume_from="step_0000002")
