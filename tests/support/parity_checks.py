"""The fp32 parity check of tests/workers/parity.py's and tp_parity.py's results against
single-process AdamW (the tolerances and why: tests/multirank/test_parity.py), and the
cases that run those workers in batches (support/batch.py)."""
import importlib.util

import pytest

from batch import Case, worker

ULP1 = 2.0 ** -23
ZOO_TIMEOUT = 400  # transformers models at N = 3 on a loaded 2-core machine
# decided at collection, so that the batch leaves out the cases of skipped tests
needs_transformers = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                        reason="transformers is not installed")


def parity(n: int, *args: str, timeout: float = 180) -> Case:
    """tests/workers/parity.py on n ranks."""
    return worker(n, "parity", *args, timeout=timeout)


def tp_parity(n: int, *args: str, needs: tuple = ()) -> Case:
    """tests/workers/tp_parity.py on n ranks."""
    return worker(n, "tp_parity", *args, needs=needs, timeout=400)


def check_fp32(r, stages=(0, 1, 2, 3)):
    tol = 16 * max(r["floor"], ULP1)
    for stage in stages:
        d = r[f"stage{stage}"]
        assert len(d["losses"]) == len(d["norms"]) == len(r["ref_losses"]) > 0, stage  # zip below
        assert d["grad_rel_err"] < 1e-5, (stage, d["grad_rel_err"])
        for a, b in zip(d["norms"], r["ref_norms"]):
            assert abs(a - b) <= 1e-5 * b, (stage, a, b)
        for a, b in zip(d["losses"], r["ref_losses"]):
            assert abs(a - b) <= 1e-5, (stage, a, b)
        assert d["max_diff"] <= tol, (stage, d["max_diff"], tol)
