"""Reliability of runs and their files (issue 14): a full disk, divergence, resume
mismatches, damaged checkpoints, two jobs on one run directory, ranks that see different
files or data, dead jobs' leftovers, inspect. Real mpiexec jobs and real files, a hard
deadline per test. Stuck and signalled jobs: tests/system/test_watchdog.py; the cleanup
rules alone: tests/unit/test_rundir.py."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mpirun import WORKERS, launch, run_mpi, running_job, torch_unimportable
from reliability_jobs import FAST, HANG, TRAIN, one_error, train


@pytest.fixture
def small_fs(tmp_path):
    """A 4 MiB tmpfs: a real filesystem that really fills up (needs root)."""
    mnt = tmp_path / "fs"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_disk_full_during_save_leaves_nothing_behind(small_fs, tmp_path, mode):
    """The filesystem fills up during the second save: every rank gets the error, the
    same one message, which names the file and the space needed; the first checkpoint
    stays, `latest` names it, and no temporary directory is left. async: the save is
    written in the background while training goes on, and the failure surfaces at the
    next step's poll, on every rank at the same step."""
    out = tmp_path / "out.json"
    run_mpi(2, [str(WORKERS / "diskfull.py"), str(small_fs / "ck"), str(out), mode], timeout=90)
    import json

    res = json.loads(out.read_text())
    assert all(e is not None for e in res["errors"]) and len(set(res["errors"])) == 1, res
    if mode == "async":
        assert len(set(res["steps"])) == 1 and res["steps"][0] is not None, res["steps"]
    msg = res["errors"][0]
    assert "rank-0000" in msg and ".h5" in msg and "out of space" in msg and "MiB free there now" in msg, msg
    assert "needs about" in msg and "the previous checkpoint is untouched" in msg
    assert res["listing"] == ["a", "latest"], res["listing"]
    assert res["latest"] == "a"


@pytest.fixture(scope="module")
def base_run(tmp_path_factory, corpus):
    """4 steps, a checkpoint after each (all kept)."""
    run_dir = tmp_path_factory.mktemp("base") / "run"
    res = train(run_dir, corpus)
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"no checkpoint in {run_dir / 'checkpoints'}: starting a FRESH run" in res.stderr
    return run_dir


def copy_run(base_run, tmp_path):
    import shutil

    dst = tmp_path / "run"
    shutil.copytree(base_run, dst)
    return dst


def test_divergence_stops_and_the_newest_good_checkpoint_survives(base_run, corpus, tmp_path):
    """Resume at lr 1e30: step 5 is finite but wrecks the weights, steps 6-8 are not
    finite (each logged with its step), the job stops after 3 in a row (exit 4) without
    checkpointing them, and keep_last=1 still left the step-4 checkpoint in place."""
    run_dir = copy_run(base_run, tmp_path)
    res = train(run_dir, corpus, "--max_steps", "30", "--keep_last", "1", "--zero.optimizer.lr", "1e30",
                "--min_lr", "0")
    one_error(res, 4, "3 steps in a row with a non-finite loss or gradient")
    for s in (6, 7, 8):
        assert f"zerompi: step {s}: non-finite gradient norm ({s - 5} in a row)" in res.stderr, res.stderr[-3000:]
    for s in (6, 7):  # step 8 stops the job before its checkpoint
        assert f"step {s} was not finite: no checkpoint" in res.stderr
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step_"))
    assert ckpts == ["step_0000004", "step_0000005"], ckpts
    from zerompi.checkpoint import verify_checkpoint

    verify_checkpoint(run_dir / "checkpoints" / "step_0000004")


def test_resume_mismatches(base_run, corpus, tmp_path):
    """Another architecture with the same shapes is an error naming the key, before any
    rank imports torch (trainer/preflight.py); changed optimizer hyper-parameters are an
    error unless --override_optimizer (then logged); a new max_steps is logged as a
    schedule change."""
    run_dir = copy_run(base_run, tmp_path)
    one_error(train(run_dir, corpus, "--model.n_head", "4", "--max_steps", "5",
                    env=torch_unimportable(tmp_path / "no-torch")), 2,
              "another model architecture: model n_head: checkpoint 2, config 4")
    one_error(train(run_dir, corpus, "--zero.optimizer.weight_decay", "0.2", "--max_steps", "5"), 2,
              "param group 0 weight_decay: checkpoint 0.01, config 0.2")
    res = train(run_dir, corpus, "--zero.optimizer.weight_decay", "0.2", "--zero.optimizer.betas", "0.8,0.9",
                "--override_optimizer", "true", "--max_steps", "5")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "override_optimizer: using the config's optimizer hyper-parameters" in res.stderr
    assert "weight_decay: checkpoint 0.01, config 0.2" in res.stderr and "betas: checkpoint (0.9, 0.999)" in res.stderr
    assert "schedule changed since the checkpoint: max_steps 4 -> 5" in res.stderr
    assert "resumed at step 4" in res.stdout


def test_damaged_latest_falls_back_and_resume_from(base_run, corpus, tmp_path):
    """The latest checkpoint is corrupt: the run resumes from the newest one that
    verifies, saying so loudly; --resume_from picks one explicitly and never falls back."""
    run_dir = copy_run(base_run, tmp_path)
    ck = run_dir / "checkpoints"
    victim = ck / "step_0000004" / "rank-00001.h5"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    res = train(run_dir, corpus, "--max_steps", "5")
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"WARNING: checkpoint {ck / 'step_0000004'} is damaged and is skipped" in res.stderr
    assert "rank-00001.h5: checksum (" in res.stderr and "mismatch, the file is corrupt" in res.stderr
    assert f"RESUMING FROM AN OLDER CHECKPOINT, {ck / 'step_0000003'}" in res.stderr
    assert "resumed at step 3" in res.stdout

    run2 = copy_run(base_run, tmp_path / "b")
    res = train(run2, corpus, "--max_steps", "5", "--resume_from", "step_0000002")
    assert res.returncode == 0 and "resumed at step 2" in res.stdout, res.stderr[-3000:]
    res = train(run2, corpus, "--max_steps", "5", "--resume_from", str(run2 / "checkpoints" / "step_0000001"))
    assert res.returncode == 0 and "resumed at step 1" in res.stdout, res.stderr[-3000:]
    one_error(train(run2, corpus, "--resume_from", "step_9", env=torch_unimportable(tmp_path / "no-torch")), 2,
              "--resume_from step_9: no checkpoint there nor in")  # said before any rank imports torch
    (run2 / "checkpoints" / "step_0000003" / "rank-00000.h5").unlink()
    one_error(train(run2, corpus, "--max_steps", "5", "--resume_from", "step_0000003"), 2,
              "--resume_from step_0000003: cannot load checkpoint")


def test_second_job_on_a_run_directory_fails_naming_the_holder(corpus, tmp_path):
    """Job A runs; job B on the same run_dir fails at once (exit 5) naming A's host and
    pid; A is not disturbed. A lock left by a dead process is taken over, saying so. The
    other holders (a requeued Slurm job, another host's live or silent job), decided by the
    same RunLock: tests/unit/test_rundir.py."""
    import json
    import socket

    run_dir = tmp_path / "run"
    cmd = ["mpiexec", "-n", "2"] + TRAIN + FAST + ["--data", corpus, "--run_dir", str(run_dir),
                                                   "--max_steps", "100000", "--checkpoint_interval", "0"]
    with running_job(cmd, (run_dir / "metrics.jsonl").exists) as a:
        holder = json.loads((run_dir / ".lock").read_text())
        b = train(run_dir, corpus, timeout=30)
        one_error(b, 5, f"is in use by another job (host {socket.gethostname()}, pid {holder['pid']}")
        assert b.elapsed < 15, b.elapsed
        assert a.poll() is None  # A runs on
        a.send_signal(signal.SIGUSR1)  # A checkpoints and ends (exit 124), releasing the lock
        out, _ = a.communicate(timeout=60)
        assert a.returncode == 124, out[-3000:]
    assert not (run_dir / ".lock").exists()

    dead = subprocess.Popen(["true"])
    dead.wait()
    lock = {"host": socket.gethostname(), "pid": dead.pid, "start": "1", "slurm_job_id": None,
            "slurm_restart_count": 0, "since": "earlier"}
    (run_dir / ".lock").write_text(json.dumps(lock))
    res = train(run_dir, corpus, "--max_steps", "1", "--resume", "false")
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"took over the lock of host {socket.gethostname()}, pid {dead.pid}" in res.stderr
    assert "its process is gone" in res.stderr


def _only_rank1(tmp_path, script):
    """MPMD prefix pieces: rank 1 runs in its own mount namespace after `script` (a
    directory or file that rank 0 sees differently: node-local disks, a missing mount)."""
    if subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode != 0:
        pytest.skip("unshare -m needs root")
    wrapper = tmp_path / "rank1.sh"
    wrapper.write_text(f"#!/bin/sh\nset -e\n{script}\nexec \"$@\"\n")
    wrapper.chmod(0o755)
    return ["unshare", "-m", "--propagation", "private", str(wrapper)]


def mpmd(run_dir, corpus, rank1_prefix, *extra, timeout=60, env=None):
    argv = TRAIN + FAST + ["--data", corpus, "--run_dir", str(run_dir)] + list(extra)
    return launch(["mpiexec", "-n", "1"] + argv + [":", "-n", "1"] + rank1_prefix + argv, timeout,
                  env=env, stderr_apart=True)


def test_checkpoint_rank_0_sees_but_rank_1_does_not(base_run, corpus, tmp_path):
    """Rank 1's view of the checkpoints folder is an empty tmpfs (as a node-local disk
    or a missing mount would be): the job fails at once naming rank 1, no hang."""
    run_dir = copy_run(base_run, tmp_path)
    prefix = _only_rank1(tmp_path, f"mount -t tmpfs tmpfs {run_dir / 'checkpoints'}")
    res = mpmd(run_dir, corpus, prefix, "--max_steps", "5")
    one_error(res, 2, f"rank 1 cannot see checkpoint {run_dir / 'checkpoints' / 'step_0000004'}, "
                      "which rank 0 chose: is the run directory on a filesystem every node mounts?")


def test_ranks_reading_different_data_are_stopped(corpus, tmp_path):
    """Same --data path, other content on rank 1 (a stale per-node copy): the
    fingerprints differ, the job stops before any rank imports torch, naming rank 1 and
    the value."""
    other = tmp_path / "other.bin"
    data = bytearray(open(corpus, "rb").read())
    data[200] ^= 1  # token 100 differs: inside the fingerprint's first window at any corpus size
    other.write_bytes(bytes(data))
    prefix = _only_rank1(tmp_path, f"mount --bind {other} {corpus}")
    res = mpmd(tmp_path / "run", corpus, prefix, env=torch_unimportable(tmp_path / "no-torch"))
    one_error(res, 2, "rank 1 has a different data set than rank 0: train.sha256 = ")


def test_dead_jobs_shared_memory_is_removed_at_start(corpus, tmp_path):
    """An old MPICH segment that no process maps (what a SIGKILLed job leaves) is removed
    by the next job on the node; one a live process maps, or a brand-new one, is left
    alone (checked in a private folder: other jobs on this machine clean /dev/shm too)."""
    import mmap

    from zerompi.runtime.rundir import clean_dead_shm

    old = time.time() - 600
    for name in ("mpich_shm_dead_0", "mpich_shm_live_0", "mpich_shm_new_0", "other_0"):
        (tmp_path / name).write_bytes(b"\0" * 4096)
        if name != "mpich_shm_new_0":
            os.utime(tmp_path / name, (old, old))
    fd = os.open(tmp_path / "mpich_shm_live_0", os.O_RDWR)
    m = mmap.mmap(fd, 4096)
    try:
        assert clean_dead_shm(str(tmp_path)) == ["mpich_shm_dead_0"]
    finally:
        m.close()
        os.close(fd)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mpich_shm_live_0", "mpich_shm_new_0", "other_0"]

    # In /dev/shm any job that another test worker starts removes a planted dead segment
    # too (rightly), within the seconds our job takes to start: so rank 0 of our job plants
    # it at the moment it cleans, and again if another job's cleaner took it in between
    # (the selection itself is checked above, in a folder of its own).
    dead = Path(f"/dev/shm/mpich_shm_zerompitest_{os.getpid()}_0")
    try:
        res = train(tmp_path / "run", corpus, "--max_steps", "1",
                    command=[sys.executable, "-c", PLANT_AT_CLEAN, str(dead)])
        assert res.returncode == 0, res.stderr[-3000:]
        assert not dead.exists()
        assert "shared-memory segment(s) of dead jobs from /dev/shm" in res.stderr, res.stderr[-3000:]
    finally:
        dead.unlink(missing_ok=True)


PLANT_AT_CLEAN = """
import os, runpy, sys, time
import zerompi.runtime.rundir as rundir
dead, clean = sys.argv.pop(1), rundir.clean_dead_shm
def plant_then_clean(*args, **kw):
    for _ in range(10):  # again only when another job's cleaner took it in between
        with open(dead, "wb") as f:
            f.write(bytes(4096))
        os.utime(dead, (time.time() - 600,) * 2)
        removed = clean(*args, **kw)
        if os.path.basename(dead) in removed or os.path.exists(dead):
            break
    return removed
rundir.clean_dead_shm = plant_then_clean
runpy.run_module("zerompi.train", run_name="__main__", alter_sys=True)
"""


def test_divergence_in_a_user_loop_is_one_line(tmp_path):
    """The engine API without the train CLI: a NaN on one rank skips the step on every
    rank (logged with its step), and the third in a row ends the job with exit 4 and one
    line from rank 0, no traceback per rank."""
    r = run_mpi(3, [HANG, "nan", "2"], timeout=60, module=False, check=False)
    assert r.returncode == 4, r.stdout[-3000:]
    for s, k in ((2, 1), (3, 2), (4, 3)):
        assert f"zerompi: step {s}: non-finite gradient norm ({k} in a row): update skipped" in r.stdout
    assert r.stdout.count("zerompi: error: step 4: 3 steps in a row with a non-finite loss") == 1, r.stdout
    assert "Traceback" not in r.stdout


def test_fp16_loss_scale_collapse_is_one_line(tmp_path):
    """fp16: every overflow is logged with the new scale; overflowing at fp16.min_scale
    ends the job like a divergence (exit 4, one line)."""
    r = run_mpi(2, [HANG, "nan-fp16", "2"], timeout=60, module=False, check=False)
    assert r.returncode == 4, r.stdout[-3000:]
    assert "zerompi: step 2: fp16 overflow, loss scale 4 -> 2: update skipped" in r.stdout, r.stdout[-3000:]
    assert "zerompi: step 3: fp16 overflow, loss scale 2 -> 1: update skipped" in r.stdout
    assert r.stdout.count("zerompi: error: fp16 gradients overflow (inf/nan) at the minimum loss scale") == 1
    assert "Traceback" not in r.stdout


def test_inspect_verifies_by_default(base_run, tmp_path):
    """inspect verifies unless told not to; with --no-verify it still refuses statistics
    of a checkpoint whose files are visibly damaged (they would read as zeros)."""
    run_dir = copy_run(base_run, tmp_path)
    ckpt = run_dir / "checkpoints" / "step_0000004"
    f = ckpt / "rank-00001.h5"
    f.write_bytes(f.read_bytes()[:-100])
    cmd = [sys.executable, "-m", "zerompi.inspect", str(ckpt)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and "failed verification" in p.stderr and "rank-00001.h5" in p.stderr, p.stderr
    p = subprocess.run(cmd + ["--no-verify", "--tensor", "lm_head.weight"], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 1 and "not printing --tensor statistics of a damaged checkpoint" in p.stderr, p.stderr
    p = subprocess.run(cmd + ["--no-verify"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "verify: skipped" in p.stderr and "truncated" in p.stderr, p.stderr
