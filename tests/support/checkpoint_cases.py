"""Shared by the checkpoint tests (test_checkpoint.py, test_checkpoint_faults.py): the
training job that saves them, readers of what it wrote, and the base checkpoints that
conftest's session fixture `ckpt_base` builds once for both modules."""
import json
from pathlib import Path

import h5py
import numpy as np

from mpirun import run_worker
from zerompi.checkpoint import verify_checkpoint
from zerompi.checkpoint.reader import PieceReader

KINDS = ("param", "exp_avg", "exp_avg_sq")


def train_job(n, runs, tmp, name, timeout=240, **kw):
    plan = Path(tmp) / f"{name}.json"
    plan.write_text(json.dumps(runs))
    return run_worker(n, "ckpt_train", ["--runs", str(plan)], Path(tmp), timeout=timeout, **kw)


def read_dump(path):
    with h5py.File(path, "r") as f:
        return {k.replace("%2F", "/"): f[k][()] for k in f}


def full_state(ckpt):
    """Every tensor of every kind, assembled from the rank files (verified first)."""
    m = verify_checkpoint(ckpt)
    with PieceReader(ckpt, m) as r:
        return m, {k: {n: r.read_full(k, n) for n in m["tensors"]} for k in KINDS}


def max_diff(a, b):
    """Largest absolute difference over all tensors. Both sides must be finite: a NaN
    would compare False everywhere and Python's max() could silently drop it."""
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    for k in a:
        assert np.isfinite(a[k]).all() and np.isfinite(b[k]).all(), k
    return max((float(np.abs(a[k].astype(np.float64) - b[k]).max()) if a[k].size else 0.0 for k in a),
               default=0.0)


def base_checkpoints(d):
    """One N=2 job: the odd model at stages 0-3 in fp32 and the tiny GPT at stage 2 in
    bf16 train 3 steps, save, dump full_state_dict, draw random numbers, train 3 more
    steps and dump again (the uninterrupted run). Plus keep_last and client_state checks."""
    cases = {"s0": ("odd", 0, "fp32"), "s1": ("odd", 1, "fp32"), "s2": ("odd", 2, "fp32"),
             "s3": ("odd", 3, "fp32"), "bf16": ("gpt", 2, "bf16")}
    runs = []
    for key, (model, stage, prec) in cases.items():
        runs.append({"model": model, "stage": stage, "precision": prec, "plan": [
            ["train", 3], ["save", str(d / key), None], ["dump", str(d / f"{key}-at3.h5")],
            ["rng", "after-save"], ["train", 3], ["dump", str(d / f"{key}-full.h5")]]})
    runs.append({"model": "odd", "stage": 1, "plan": [
        ["train", 1], ["save_keep", str(d / "rot"), 2], ["train", 1], ["save_keep", str(d / "rot"), 2],
        ["train", 1], ["save_keep", str(d / "rot"), 2], ["save_type_error", str(d / "bad-cs")]]})
    res = train_job(2, runs, d, "base")
    assert len(res["runs"]) == len(runs) and [len(r) for r in res["runs"]] == [len(r["plan"]) for r in runs]
    return {"dir": d, "cases": cases, "runs": dict(zip(list(cases) + ["misc"], res["runs"]))}
