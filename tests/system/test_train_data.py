"""A bad --data ends `zerompi.train` with one message from rank 0 and exit 2, at start
(before any rank imports torch: trainer/preflight.py) or when a later batch holds an id
beyond the vocabulary (checks: tests/unit/test_data_check.py)."""
import numpy as np
import pytest

from bad_tokens import bad_outside_sample
from mpirun import run_mpi, torch_unimportable
from zerompi.data import write_tokens
from zerompi.data import check as dc


TRAIN = ["-m", "zerompi.train", "--model.preset", "tiny", "--global_batch", "4", "--max_steps", "3",
         "--eval_interval", "0", "--checkpoint_interval", "0", "--progress", "lines", "--threads", "1"]


def _one_message(res, needle):
    """One line from rank 0 on stderr+stdout, no traceback, exit 2."""
    assert res.returncode == 2, res.stdout
    assert res.stdout.count(needle) == 1, res.stdout
    assert "Traceback" not in res.stdout, res.stdout


@pytest.mark.parametrize("n", [2])
def test_train_rejects_a_text_file_with_one_message(tmp_path, n):
    p = tmp_path / "notes.txt"
    p.write_text("hello world\n" * 1000)
    res = run_mpi(n, TRAIN + ["--data", str(p), "--run_dir", str(tmp_path / "run")], module=False,
                  check=False, timeout=60, env=torch_unimportable(tmp_path / "no-torch"))
    _one_message(res, "this is a text file, not tokens")
    assert not (tmp_path / "run").exists()  # nothing started


def test_train_ids_beyond_vocab_found_late_end_the_job_with_one_line(tmp_path):
    n = dc._SAMPLE_CHUNKS * dc._CHUNK * 2
    write_tokens(tmp_path / "d.bin", bad_outside_sample(n))
    res = run_mpi(2, TRAIN + ["--data", str(tmp_path / "d.bin"), "--run_dir", str(tmp_path / "run")],
                  module=False, check=False, timeout=60)
    assert res.returncode == 2, res.stdout
    assert "found while training" in res.stdout and "Traceback" not in res.stdout, res.stdout


def test_train_names_out_of_vocab_ids_at_start(tmp_path):
    ids = np.random.default_rng(0).integers(0, 256, 20_000)
    ids[100] = 4000
    write_tokens(tmp_path / "d.bin", ids)
    res = run_mpi(2, TRAIN + ["--data", str(tmp_path / "d.bin"), "--run_dir", str(tmp_path / "run")],
                  module=False, check=False, timeout=60, env=torch_unimportable(tmp_path / "no-torch"))
    _one_message(res, "token id 4000 at position 100")  # before any rank imports torch
