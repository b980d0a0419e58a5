"""A token file that passes the start-up sample of zerompi/data/check.py and fails later,
for the lazy per-batch check (tests/unit/test_data_check.py, tests/system/test_train_data.py)."""
import numpy as np

from zerompi.data import check as dc


def bad_outside_sample(n: int) -> np.ndarray:
    """Every id bad (999) except the chunks the start-up sample reads."""
    ids = np.full(n, 999, np.int64)
    for s in np.linspace(0, n - dc._CHUNK, dc._SAMPLE_CHUNKS).astype(np.int64):
        ids[s:s + dc._CHUNK] = 7
    return ids
