"""Tensor parallelism x ZeRO-DP on the reference GPT against single-process AdamW
(tests/workers/tp_parity.py): tp = 2 x dp = 1 and tp = 2 x dp = 2, stages 0-3, with
activation checkpointing off, plain, partitioned (Pa) and partitioned + offloaded;
tp-invariant initialisation; a checkpoint saved at tp 2 x dp 2 resumed at tp 1 x dp 3.
The vocabulary (300) is padded to 512 at tp = 2: padding must never be trained."""
import subprocess
import sys

import pytest

from mpirun import run_mpi, run_worker
from test_parity import _check_fp32


def _check(r, stages=(0, 1, 2, 3)):
    _check_fp32(r, stages=stages)
    for s in stages:
        d = r[f"stage{s}"]
        assert d["init_mismatch"] == [], (s, d["init_mismatch"])
        assert d["shapes_full"], s


@pytest.mark.parametrize("n,act", [(2, "none"), (4, "none"), (2, "partition"), (4, "plain"),
                                   (4, "partition"), (4, "offload")])
def test_tp2_matches_adamw_every_stage(n, act, tmp_path):
    r = run_worker(n, "tp_parity", ["--tp", "2", "--act", act], tmp_path, timeout=400)
    assert r["tp"] == 2 and r["world"] == n
    _check(r)


def test_tp2_dp2_fused_optimizer(tmp_path):
    """The fused optimizer's weighted norm (tp replicas weighted 1/tp in the table)."""
    r = run_worker(4, "tp_parity", ["--tp", "2", "--stages", "1,3", "--impl", "fused"], tmp_path, timeout=400)
    _check(r, stages=(1, 3))


def test_tp4_matches_adamw(tmp_path):
    """Four heads over four ranks: one head per rank; stages 1 and 3."""
    r = run_worker(4, "tp_parity", ["--tp", "4", "--stages", "1,3"], tmp_path, timeout=400)
    _check(r, stages=(1, 3))


def test_checkpoint_tp2_dp2_resumes_at_tp1_dp3(tmp_path):
    """Saved at tp 2 x dp 2 after 2 steps (stage 2), loaded at tp 1 x dp 3 (stage 3),
    3 more steps: parity with 5 uninterrupted single-process steps."""
    ckpt = tmp_path / "ckpt"
    run_worker(4, "tp_parity", ["--tp", "2", "--stages", "2", "--steps", "2", "--save", str(ckpt)],
               tmp_path, timeout=400)
    r = run_worker(3, "tp_parity", ["--tp", "1", "--stages", "3", "--start", "2", "--steps", "3",
                                    "--load", str(ckpt)], tmp_path, timeout=400)
    _check(r, stages=(3,))


def test_trainer_tp2_then_resume_at_tp1_and_export(corpus, tmp_path):
    """`zerompi.train --zero.tensor_parallel_size 2` on 4 ranks with Pa, then the same
    run_dir resumed on 2 ranks at tp 1; the exported weights load strictly into the plain
    GPT (full shapes, no vocabulary padding)."""
    import torch

    from zerompi.models.gpt import GPT, PRESETS

    run = tmp_path / "run"
    common = ["-m", "zerompi.train", "--model.preset", "tiny", "--data", str(corpus), "--run_dir", str(run),
              "--global_batch", "4", "--eval_interval", "0", "--progress", "none", "--threads", "1",
              "--zero.stage", "3"]
    r = run_mpi(4, common + ["--max_steps", "3", "--zero.tensor_parallel_size", "2",
                             "--zero.activation_checkpointing.enabled", "true",
                             "--zero.activation_checkpointing.partition", "true"], module=False, timeout=120)
    assert "4 ranks x 1 threads (dp 2 x tp 2)" in r.stdout, r.stdout[-2000:]
    r = run_mpi(2, common + ["--max_steps", "5"], module=False, timeout=120)
    assert "resumed at step 3" in r.stdout, r.stdout[-2000:]
    p = subprocess.run([sys.executable, "-m", "zerompi.export", str(run / "checkpoints"), str(tmp_path / "x"),
                        "--format", "torch"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    GPT(PRESETS["tiny"]).load_state_dict(torch.load(tmp_path / "x" / "model.pt", weights_only=True), strict=True)
