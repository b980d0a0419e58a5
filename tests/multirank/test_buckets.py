"""Results must not depend on the bucket size: bitwise-identical parameters for four
bucket sizes (64 elements: ~hundreds of blocks; 1000; 100000: a single block; 300 as a
floor, the layout bucket_size "auto" makes at large N: blocks >= 300), at an
uneven world size. This holds because every element is summed in rank order whatever
the block size (ordered reduce-scatter), the optimizer is elementwise, and the norm is
summed in float64 (its rounding cannot move the fp32 clip coefficient here)."""
import pytest

from batch import batched, worker


@batched(lambda n, precision: worker(n, "buckets", "--precision", precision))
@pytest.mark.parametrize("n,precision", [(3, "fp32"), (4, "bf16")])
def test_bucket_size_invariance(n, precision, result):
    r = result
    for stage in (0, 1, 2):
        runs = {b: r[f"{stage}/{b}"] for b in ("64", "1000", "100000", "300+")}
        assert runs["64"]["blocks"] > 10 and runs["100000"]["blocks"] == 1
        # balanced blocks: each <= 64 (rounded to N * 16), or each >= 300 with at_least
        assert max(runs["64"]["block_sizes"]) <= -(-64 // (16 * n)) * 16 * n
        assert runs["300+"]["blocks"] > 1 and min(runs["300+"]["block_sizes"]) >= 300
        assert len({v["master"] for v in runs.values()}) == 1, (stage, runs)
        assert all(v["ranks_agree"] for v in runs.values()), (stage, runs)
