"""`python -m zerompi.train` with `compile = true` (per-block torch.compile), TensorBoard
and Weights & Biases (offline) at N = 2, stage 3: the blocks are compiled, and the event
files and the W&B run hold metrics.jsonl's values. The commands of docs/quickstart.md's
"torch.compile" and "TensorBoard and Weights & Biases" sections, on a smaller run."""
import glob
import json
import struct

import numpy as np
import pytest

from mpirun import run_mpi

tensorboard = pytest.importorskip("tensorboard", reason="pip install tensorboard (setup.py's test extra)")

# aot_eager: what the test checks is the trainer's wiring; inductor's own speed is measured
# in benchmarks/bench_compile.py, and the graphs' correctness in tests/multirank/test_compile.py.
RUN = ["-m", "zerompi.train", "--model.preset", "tiny", "--global_batch", "4", "--max_steps", "4",
       "--warmup_steps", "2", "--eval_interval", "2", "--eval_batches", "1", "--checkpoint_interval", "0",
       "--progress", "lines", "--zero.stage", "3", "--compile", "true", "--compile_backend", "aot_eager",
       "--tensorboard", "true"]


def has_wandb() -> bool:
    try:
        import wandb  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(scope="module")
def run(tmp_path_factory, corpus):
    run_dir = tmp_path_factory.mktemp("compile_log") / "run"
    extra = ["--wandb", "true"] if has_wandb() else []
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DIR": str(run_dir.parent)}
    res = run_mpi(2, RUN + ["--data", corpus, "--run_dir", str(run_dir)] + extra, timeout=300, env=env,
                  module=False)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return run_dir, res, rows


def test_compile_true_compiles_the_blocks_and_trains(run):
    run_dir, res, rows = run
    assert "blocks compiled (aot_eager)" in res.stdout, res.stdout[-2000:]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and all(np.isfinite(r["loss"]) for r in rows)


def test_tensorboard_events_hold_the_metrics(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, _, rows = run
    files = glob.glob(str(run_dir / "tensorboard" / "events.out.tfevents.*"))
    assert len(files) == 1, files  # rank 0 only
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "val_loss"} <= tags, tags
    for tag in tags:
        want = {r["step"]: r[tag] for r in rows if tag in r}
        got = {e.step: e.value for e in acc.Scalars(tag)}
        assert got.keys() == want.keys(), (tag, got, want)
        for step, v in want.items():  # events hold float32
            assert got[step] == pytest.approx(float(np.float32(v)), rel=1e-6, abs=0), (tag, step)


def wandb_history(path: str) -> dict[int, dict]:
    """The history rows of an offline run's .wandb file, by step. Its format: a 7-byte file
    header, then records in 32 KiB blocks, each record a 7-byte header (crc32, length,
    kind: 1 whole, 2 first, 3 middle, 4 last piece) and a piece of a protobuf Record
    (wandb 0.31 ships no reader of its own)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, piece, rows = open(path, "rb").read(), 7, b"", {}
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header: padding
            pos += 32768 - pos % 32768
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        piece += data[pos + 7:pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(piece)
            piece = b""
            if rec.WhichOneof("record_type") == "history":
                rows[rec.history.step.num] = {i.key or ".".join(i.nested_key): json.loads(i.value_json)
                                              for i in rec.history.item}
    return rows


def test_wandb_offline_run_holds_the_metrics(run):
    if not has_wandb():
        pytest.skip("wandb is not installed (pip install wandb)")
    run_dir, _, rows = run
    files = glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(files) == 1, files  # rank 0 only
    history = wandb_history(files[0])
    assert sorted(history) == [1, 2, 3, 4], sorted(history)
    for r in rows:
        got = history[r["step"]]
        for k in ("loss", "lr", "grad_norm", "tokens_per_s", "val_loss"):
            if k in r:
                assert got[k] == pytest.approx(r[k], rel=1e-12), (k, r["step"])
        assert ("val_loss" in got) == ("val_loss" in r)
