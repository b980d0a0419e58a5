"""The staged offload pipeline (zero/offload.py) on N ranks, on the CPU: its parity with
single-process AdamW at every stage (the copy pipeline's: tests/multirank/test_parity.py),
and the delayed update bit for bit against the same delay applied by hand. One rank in
process, and the GPU: tests/unit/test_offload.py, tests/multirank/test_engine_gpu.py."""
import json

import pytest

from batch import batched, worker
from parity_checks import check_fp32, parity

STAGED = json.dumps({"pipeline": "staged", "tile_elements": 100})


@batched(lambda n: parity(n, "--model", "odd", "--clip", "0.05", "--offload", "cpu", "--offload-cfg", STAGED))
@pytest.mark.parametrize("n", [2, 3])
def test_staged_offload_parity(n, result):
    """Gradients staged per bucket, the fused host pass over 100-element upload tiles,
    the norm from the device's gradients: fp32, every stage, against torch's AdamW."""
    check_fp32(result)
    assert {result[f"stage{s}"]["optimizer"] for s in range(4)} == {"HostPassAdamW"}
    assert all(result[f"stage{s}"]["offloaded"] > 0 for s in range(4))


@batched(lambda n: worker(n, "offload_delay", timeout=300))
@pytest.mark.parametrize("n", [2, 3])
def test_delayed_update_is_the_hand_delayed_run(n, result):
    for stage in range(4):
        d = result[f"stage{stage}"]
        assert d["same_losses"] and d["same_norms"] and d["same_params"], (stage, d)
        assert d["optimizer"] == "HostPassAdamW"
        assert d["losses"][0] == d["plain_losses"][0] and d["losses"][2:] != d["plain_losses"][2:], d
