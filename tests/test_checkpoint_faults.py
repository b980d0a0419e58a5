"""Checkpoints under faults: SIGKILL in the middle of saves (one rank, a whole job),
damaged or half-replaced checkpoints failing on every rank with the file named, and
rotation that touches nothing but checkpoints. Shared jobs: checkpoint_cases.py."""
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import h5py
import pytest

from checkpoint_cases import train_job
from mpirun import HERE, WORKERS, mpi_env, run_mpi

ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
from zerompi.checkpoint import CheckpointError, format as fmt, verify_checkpoint  # noqa: E402
from zerompi.checkpoint.directory import resolve, rotate, write_latest  # noqa: E402


# ---------------------------------------------------------------------------- crash safety
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_crash_single_rank_many_kills(tmp_path, mode):
    """20 saves SIGKILLed at random moments (uniform in 0-0.35 s of a train+save loop
    that rotates with keep_last=2): after every kill DIR/latest verifies (checksums) and
    names at least the last save the child reported, and the next child loads it.
    async: one background save per step (a write is nearly always in flight); also every
    visible checkpoint verifies and latest names a save that was begun: the kill of the
    only rank, i.e. of all ranks, never lets an unpublished checkpoint be loaded."""
    env = mpi_env({"PYTHONPATH": os.pathsep.join([str(ROOT), str(WORKERS)])})
    out = tmp_path / "log.json"
    p = subprocess.run([sys.executable, str(WORKERS / "ckpt_crash.py"), "--dir", str(tmp_path / "ck"),
                        "--out", str(out), "--fork", "20", "--seed", "1", "--max-delay", "0.35"]
                       + (["--async"] if mode == "async" else []),
                       env=env, capture_output=True, text=True, timeout=170, start_new_session=True)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    log = json.loads(out.read_text())
    assert len(log) == 20
    # The kills did land inside saves: some left a partial .tmp-* behind (async: most,
    # since a background write is in flight nearly all the time).
    hit = sum(bool(t["leftovers"]) for t in log)
    assert hit >= (10 if mode == "async" else 1), log
    verify_checkpoint(tmp_path / "ck")


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_crash_two_ranks(tmp_path, mode):
    """SIGKILL of a whole 2-rank job (its process group, like a node failure or scancel)
    at a random moment after its first save, i.e. inside a later save (async: inside a
    background write; 5 jobs); the next job loads and verifies the latest checkpoint and
    its successful save cleans up."""
    ck = str(tmp_path / "ck")
    args = [str(WORKERS / "ckpt_crash.py"), "--dir", ck, "--mpi"] + (["--async"] if mode == "async" else [])
    rng = random.Random(2)
    for trial in range(5 if mode == "async" else 3):   # async: 20 + 5 + 6 kill trials in this file
        cmd = ["mpiexec", "-n", "2", sys.executable, "-m", "mpi4py"] + args
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env=mpi_env(), start_new_session=True)
        seen = []
        try:
            deadline = time.monotonic() + 120
            while not (seen and seen[-1].startswith("saved")) and time.monotonic() < deadline:
                line = p.stdout.readline()
                assert line or p.poll() is None, "worker exited early:\n" + "".join(seen)
                seen.append(line)
            assert seen[-1].startswith("saved"), "".join(seen)
            time.sleep(rng.uniform(0.0, 0.6))
        finally:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
            # hydra's proxy starts the ranks in a process group of their own: kill them by
            # their command line too, as a node failure would, before the next job looks
            while subprocess.run(["pkill", "-9", "-f", ck], capture_output=True).returncode == 0:
                time.sleep(0.05)
        ready = next(ln for ln in seen if ln.startswith("ready"))
        assert trial == 0 or ready.split()[1] != "0", seen  # resumed from the previous job's save
        verify_checkpoint(ck)
    out = run_mpi(2, args + ["--once"], timeout=120)
    assert "ready" in out.stdout and "saved" in out.stdout
    assert not [e for e in os.listdir(ck) if e.startswith(".")]  # a good save cleans up


def test_sigkill_of_one_rank_during_background_writes(tmp_path):
    """One rank of a 2-rank job SIGKILLs itself at a random moment (a node failure) while
    a background save is nearly always in flight (one per step): 6 jobs, rank 0 and rank
    1 each with writer thread and process; the launcher ends the job. Each time the previous checkpoint
    verifies, every visible one does, latest is not older than the last save reported
    published, and the next job resumes from it."""
    ck = tmp_path / "ck"
    base = [str(WORKERS / "ckpt_crash.py"), "--dir", str(ck), "--mpi", "--async"]
    run_mpi(2, base + ["--once"], timeout=120)
    hits = 0
    kills = [(1, "thread"), (0, "process"), (1, "process"), (0, "thread"), (1, "thread"), (0, "process")]
    for trial, (rank, writer) in enumerate(kills):
        before = verify_checkpoint(ck)["client_state"]["data_step"]
        res = run_mpi(2, base + ["--writer", writer, "--kill-rank", str(rank), "--seed", str(trial),
                                 "--max-delay", "0.6"], timeout=120, check=False)
        assert res.returncode != 0, res.stdout[-3000:]
        lines = res.stdout.splitlines()
        assert f"ready {before}" in lines, res.stdout[-3000:]   # resumed from what latest named
        saved = [ln.split()[1] for ln in lines if ln.startswith("saved")]
        m = verify_checkpoint(ck)
        for e in os.listdir(ck):
            if not e.startswith(".") and (ck / e).is_dir():
                verify_checkpoint(ck / e)
        assert not saved or m["counters"]["global_steps"] >= int(saved[-1].split("-")[1]), (saved, m["tag"])
        hits += any(e.startswith(fmt.TMP_PREFIX) for e in os.listdir(ck))
    assert hits >= 1   # some kill landed inside a background write
    t0 = time.monotonic()   # no writer helper outlived its rank (PR_SET_PDEATHSIG)
    while subprocess.run(["pgrep", "-f", "zerompi.checkpoint.writer_process"], capture_output=True).stdout.strip():
        assert time.monotonic() - t0 < 10, "a checkpoint writer process outlived its rank"
        time.sleep(0.1)


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
        (d / t / "manifest.json").write_text(json.dumps(fmt.seal(m)))
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
    os.unlink(tmp_path / "step_0000002" / fmt.MANIFEST)
    client = resume(eng, eng.dims.world, tmp_path)
    err = capfd.readouterr().err
    assert client == {"step": 1}, err
    assert f"WARNING: checkpoint {tmp_path / 'step_0000002'} is damaged and is skipped" in err, err
    assert "manifest.json: missing" in err and "cannot see" not in err, err
    assert f"RESUMING FROM AN OLDER CHECKPOINT, {tmp_path / 'step_0000001'}" in err, err
    with pytest.raises(ResumeError, match="--resume_from step_0000002: .*manifest.json: missing"):
        resume(eng, eng.dims.world, tmp_path, resume_from="step_0000002")
