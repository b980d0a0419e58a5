"""MPICommunicator collectives on 1-4 ranks (tests/workers/comm_ops.py does the checking)."""
import math

import pytest

from batch import batched, worker

CHECKS = {
    "all_reduce_sum_ordered", "all_reduce_sum_native", "all_reduce_max", "all_reduce_min",
    "all_reduce_numpy", "reduce_scatter_ordered_fp32", "reduce_scatter_native_fp32",
    "reduce_scatter_ordered_bf16", "all_gather_float32", "all_gather_bfloat16", "broadcast",
    "allreduce_scalars", "async_reverse_wait", "split_even_odd", "stats",
    "size_mismatch_raises", "bucket_independence", "barrier_poll",
}


@batched(lambda n: worker(n, "comm_ops", timeout=120))
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_collectives(n, result):
    res = result
    assert res["ok"] is True and res["world"] == n
    want = CHECKS | ({"reduce_scatter_native_bf16_refused"} if n > 1 else set())
    assert set(res["checks"]) == want, sorted(want ^ set(res["checks"]))
    # counting convention: reduce_scatter counts its input, all_gather its output
    ex = res["stats_example"]
    assert ex["all_gather"]["elements"] == 6 * n and ex["reduce_scatter"]["elements"] == 8 * n
    # the bucket-independence sweep ran for every block size; the native algorithm's
    # elements that differ from the ordered sum are a count out of every element compared
    # (how many is MPICH's business, except that a sum of one or two fp32 terms has only
    # one correctly rounded result, whatever the order)
    sweep = res["native_elements_differing_from_ordered"]
    assert sorted(sweep, key=int) == ["1", "64", "300", "1000", "4096", "1000000000"], sweep
    for req, m in sweep.items():
        assert m["compared"] == m["total"] > 0, (req, m)  # the chunks of all ranks tile the buffer
        d = m["differing"]
        assert math.isfinite(d) and d == int(d) and 0 <= d <= m["compared"], (req, m)
        if n <= 2:
            assert d == 0, (req, m)
