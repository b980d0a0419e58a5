"""Asynchronous checkpoints (issue 27): the same checkpoint as a synchronous save, written
in the background while training goes on, published only at a step boundary once every
rank wrote. Crash safety under SIGKILL: test_checkpoint_faults.py; disk full:
test_reliability.py; the train CLI's exits: test_checkpoint_async_train.py."""
import json
import os
import sys
import time

import h5py
import numpy as np
import pytest
import torch

from batch import batched, worker
from checkpoint_cases import read_dump
from mpirun import WORKERS, run_mpi

import zerompi
from zerompi.checkpoint import CheckpointError, flush, poll, save, verify_checkpoint
from zerompi.checkpoint import naming

CASES = {"s0": ("odd", 0, "fp32"), "s1": ("odd", 1, "fp32"), "s2": ("odd", 2, "fp32"),
         "s3": ("shapes", 3, "fp32"), "bf16": ("gpt", 2, "bf16")}


def _job(tmp_path, name, runs):
    plan, out = tmp_path / f"{name}.json", tmp_path / f"{name}-out.json"
    plan.write_text(json.dumps(runs))
    res = run_mpi(2, [str(WORKERS / "ckpt_train.py"), "--out", str(out), "--runs", str(plan)], timeout=240)
    return json.loads(out.read_text())["runs"], res.stdout


def _rank_file_contents(path):
    """Every dataset and attribute of an HDF5 file except the tag, for comparison."""
    out = {}
    with h5py.File(path, "r") as f:
        def visit(name, obj):
            for k, v in obj.attrs.items():
                out[f"{name}@{k}"] = v
            if isinstance(obj, h5py.Dataset):
                out[name] = obj[()]
        f.visititems(visit)
        out.update({f"@{k}": v for k, v in f.attrs.items() if k != "tag"})
    return out


def _same(a, b):
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    for k in a:
        x, y = np.asarray(a[k]), np.asarray(b[k])
        assert x.dtype == y.dtype and x.shape == y.shape, k
        assert x.tolist() == y.tolist() if x.dtype.hasobject else x.tobytes() == y.tobytes(), k  # bitwise


def test_async_checkpoint_is_the_sync_one_and_resumes_bitwise(tmp_path):
    """N=2, stages 0-3 in fp32 and stage 2 in bf16: after 3 steps a synchronous save B,
    then an asynchronous save A of the same state whose snapshot copy starts 0.3 s late,
    while 2 more steps run (their updates must wait for the copy). A holds exactly B's
    values, RNG states, counters and buffers; a new job resumed from A trains on bitwise
    like one resumed from B. A second save requested while one is in flight waits for
    it, says how long on rank 0, and both are published in order."""
    d = tmp_path
    runs = [{"model": m, "stage": st, "precision": p, "plan": ([["slow_copy", 0.3]] if i == 0 else []) + [
        ["train", 3], ["save", str(d / f"B-{k}"), "t"], ["save_async", str(d / f"A-{k}"), "t"],
        ["train", 2], ["flush"]]} for i, (k, (m, st, p)) in enumerate(CASES.items())]
    runs.append({"model": "odd", "stage": 1, "plan": [
        ["train", 1], ["save_async", str(d / "W"), "w1"], ["save_async", str(d / "W"), "w2"], ["flush"]]})
    res, log = _job(tmp_path, "save", runs)
    for k in CASES:
        a, b = d / f"A-{k}" / "t", d / f"B-{k}" / "t"
        ma, mb = verify_checkpoint(a), verify_checkpoint(b)
        assert ma["counters"] == mb["counters"] and ma["counters"]["global_steps"] == 3, k
        assert ma["tensors"] == mb["tensors"] and ma["module_tensors"] == mb["module_tensors"], k
        assert ma["client_state"] == mb["client_state"], k
        for r in range(2):
            _same(_rank_file_contents(a / naming.rank_file(r)), _rank_file_contents(b / naming.rank_file(r)))
    assert "checkpoint: waited" in log and "for the save of w1 to finish before saving w2" in log, log[-3000:]
    assert res[-1][-1]["published"] == str(d / "W" / "w2")
    assert (d / "W" / "latest").read_text().strip() == "w2" and verify_checkpoint(d / "W" / "w1")

    runs = [{"model": m, "stage": st, "precision": p, "plan": [
        ["load", str(d / f"{side}-{k}"), None], ["rng", "after-load"], ["train", 3],
        ["dump", str(d / f"{side}-{k}.h5")]]} for k, (m, st, p) in CASES.items() for side in "AB"]
    res, _ = _job(tmp_path, "resume", runs)
    for i, k in enumerate(CASES):
        ra, rb = res[2 * i], res[2 * i + 1]
        assert ra[0]["global_steps"] == rb[0]["global_steps"] == 3 and ra[1]["draws"] == rb[1]["draws"], k
        da, db = read_dump(d / f"A-{k}.h5"), read_dump(d / f"B-{k}.h5")
        assert da.keys() == db.keys() and all(np.array_equal(da[n], db[n]) for n in da), k


@pytest.fixture
def engine():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(40, 50), torch.nn.BatchNorm1d(50), torch.nn.Linear(50, 60))
    return zerompi.initialize(m, {"stage": 2, "precision": "fp32"})


def _step(eng):
    loss = eng(torch.randn(8, 40)).pow(2).mean()
    eng.backward(loss)
    eng.step()


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_background_failure_is_the_sync_message_and_leaves_nothing(engine, tmp_path, writer):
    """A background write that fails (here: the writer refuses a diverged state) raises
    at the poll, as CheckpointError with the synchronous save's message (the helper
    process's error keeps its class name); no directory is left, latest is untouched,
    and the saver is free for the next save."""
    save(engine, tmp_path, tag="good")
    st = engine.export_state(views=True)
    j = [p[0] for p in st["pieces"]].index("2.weight")
    saved = st["tensors"]["exp_avg"][j].view(-1)[-1].item()
    st["tensors"]["exp_avg"][j].view(-1)[-1] = float("nan")
    path = save(engine, tmp_path, tag="bad", async_save=True, writer=writer)
    assert path == str(tmp_path / "bad") and not os.path.exists(path)   # not published yet
    with pytest.raises(CheckpointError) as e:
        for _ in range(3000):
            poll(engine)   # a step boundary each time, here without steps
            time.sleep(0.01)
    msg = str(e.value)
    assert "FloatingPointError: refusing to checkpoint a diverged state: exp_avg of 2.weight holds inf/nan" in msg
    assert "nothing was written; the previous checkpoint is untouched" in msg and "rank-00000.h5" in msg
    assert sorted(os.listdir(tmp_path)) == ["good", "latest"]
    st["tensors"]["exp_avg"][j].view(-1)[-1] = saved
    save(engine, tmp_path, tag="again", async_save=True, writer=writer)
    assert flush(engine)["tag"] == "again" and (tmp_path / "latest").read_text() == "again\n"


def test_staging_is_allocated_once_through_the_engines_placement(engine, tmp_path, monkeypatch):
    """Every save reuses one host buffer, allocated through the engine's Placement
    (device.Placement.host_staging: pinned there when the engine is on a GPU); what the
    saves snapshot is the state at the save, whatever the steps after it change."""
    from zerompi.device import Placement

    calls = []
    real = Placement.host_staging
    monkeypatch.setattr(Placement, "host_staging", lambda self, n: calls.append((self, n)) or real(self, n))
    for i in range(3):
        _step(engine)
        want = {k: torch.cat(v).clone() for k, v in engine.export_state(views=True)["tensors"].items()}
        save(engine, tmp_path, tag=f"t{i}", async_save=True, keep_last=2)
        _step(engine)
        assert flush(engine)["tag"] == f"t{i}"
        with h5py.File(tmp_path / f"t{i}" / naming.rank_file(0), "r") as f:
            for kind, t in want.items():
                assert np.array_equal(f[f"state/{kind}"][()], t.numpy()), kind
    assert len(calls) == 1 and calls[0][0] is engine.state.placement, calls
    assert sorted(e for e in os.listdir(tmp_path) if e[0] != ".") == ["latest", "t1", "t2"]  # keep_last=2


def test_a_snapshot_that_cannot_be_taken_fails_the_save(engine, tmp_path, monkeypatch):
    """No host memory for the staging buffer (or any other failure before the background
    write starts): reported like a failed background write, at the next poll on every
    rank, the temporary directory removed."""
    from zerompi.checkpoint.background import snapshot as staging

    def no_memory(*a, **k):
        raise MemoryError("staging")

    monkeypatch.setattr(staging.Staging, "__init__", no_memory)
    save(engine, tmp_path, tag="t", async_save=True)
    with pytest.raises(CheckpointError, match="rank-00000.h5: RuntimeError: cannot take the snapshot: "
                                              "MemoryError: staging"):
        flush(engine)
    assert os.listdir(tmp_path) == [] and flush(engine) is None


def test_unflushed_save_is_never_published_and_says_so(tmp_path):
    """A process that exits with a save in flight leaves only a hidden temporary
    directory (never loaded, removed by the next save's cleanup) and says so."""
    code = ("import torch, zerompi, sys; from zerompi.checkpoint import save\n"
            "e = zerompi.initialize(torch.nn.Linear(64, 64), {'stage': 1}); save(e, sys.argv[1], tag='a')\n"
            "from zerompi.checkpoint.background.snapshot import Snapshot; import time\n"
            "c = Snapshot.copy; Snapshot.copy = lambda s: (time.sleep(30), c(s))\n"
            "save(e, sys.argv[1], tag='b', async_save=True)\n")
    res = run_mpi(1, ["-c", code, str(tmp_path)], timeout=120, module=False)
    assert "checkpoint " + str(tmp_path / "b") + " was still being written at exit and is not published" in res.stdout
    assert sorted(e for e in os.listdir(tmp_path) if not e.startswith(".")) == ["a", "latest"]
    assert (tmp_path / "latest").read_text() == "a\n" and verify_checkpoint(tmp_path)["tag"] == "a"
    assert [e for e in os.listdir(tmp_path) if e.startswith(naming.TMP_PREFIX + "b-")]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


@batched(lambda: worker(2, "poll_lag", "--dir", "{dir}/ck", "--lag", "0.1", "--write-s", "1.0"))
def test_the_poll_does_not_wait_for_a_late_rank(result):
    """Rank 1 reaches every step boundary 0.1 s after rank 0 while a write takes 1 s. A
    poll reads the answer posted a step earlier (which the step's own collectives
    completed) and posts the next, so rank 0's polls do not wait for rank 1; a blocking
    all-reduce there took the 0.1 s every step, most of an asynchronous save's stall at
    stage 3. Only the two agreements of a save wait for every rank: that all files are
    written, and the publication. Both ranks publish at the same step."""
    polls, published = result["polls"], result["published"]
    assert published[0] is not None and published == [published[0]] * 2, published
    assert len(polls) >= 6, polls   # steps of 0.12-0.22 s during a 1 s write
    assert len([t for t in polls if t > 0.05]) <= 2, polls
