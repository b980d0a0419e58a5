"""Device binding and CUDA-aware MPI detection (the GPU parts run where a GPU exists).

Detection is checked against what the loaded MPI library itself answers (asked
independently in the worker), never against a fact of one machine: pip's MPICH is not
CUDA-aware, a site MPI may be; both must be reported as they are."""
import json

import pytest
import torch

from batch import batched, worker

VAR = "ZEROMPI_CUDA_AWARE_MPI"


@batched(lambda: worker(3, "device_bind"))
def test_local_ranks_and_detection(result):
    r = result
    assert sorted(i["local"] for i in r) == [0, 1, 2]  # one node: local rank == rank here
    assert all(i["per_node"] == 3 for i in r)
    assert all(i["libs"] for i in r), "the MPI library mpi4py loaded was not found"
    for i in r:
        # MPIX_Query_cuda_support's answer, or False where the library lacks the function
        want = bool(i["queried"]) if i["queried"] is not None else False
        assert i["detected"] == {"value": want}, i
    assert len({json.dumps(i["detected"]) for i in r}) == 1  # one library, one answer
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    expect = [f"cuda:{i['local'] % n}" if n else "cpu" for i in r]
    assert [i["device"] for i in r] == expect


@batched(lambda value: worker(2, "device_bind", env={VAR: value}))
@pytest.mark.parametrize("value", ["0", "1"])
def test_detection_override(result, value):
    """ZEROMPI_CUDA_AWARE_MPI=0/1 decides, whatever the library says; the library's own
    answer is still what detection gives without the variable."""
    r = result
    for i in r:
        assert i["as_launched"] == {"value": value == "1"}, i
        want = bool(i["queried"]) if i["queried"] is not None else False
        assert i["detected"] == {"value": want}, i


@batched(lambda value: worker(2, "device_bind", env={VAR: value}))
@pytest.mark.parametrize("value", ["yes", "true", ""])
def test_detection_override_invalid(result, value):
    """Anything but 0/1 is a ValueError naming the variable and the value it had."""
    r = result
    for i in r:
        got = i["as_launched"]
        assert got.get("error") == "ValueError", i
        assert VAR in got["message"] and repr(value) in got["message"], got
