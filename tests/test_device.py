"""Device binding and CUDA-aware MPI detection (the GPU parts run where a GPU exists)."""
import torch

from mpirun import run_worker


def test_local_ranks_and_detection(tmp_path):
    r = run_worker(3, "device_bind", [], tmp_path)
    assert sorted(i["local"] for i in r) == [0, 1, 2]  # one node: local rank == rank here
    assert all(i["per_node"] == 3 for i in r)
    assert all(i["libs"] for i in r), "the MPI library mpi4py loaded was not found"
    # pip's MPICH is not CUDA-aware (FACTS.md); a site MPI may be.
    assert all(i["cuda_aware"] is False for i in r)
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    expect = [f"cuda:{i['local'] % n}" if n else "cpu" for i in r]
    assert [i["device"] for i in r] == expect


def test_detection_override(tmp_path):
    r = run_worker(2, "device_bind", [], tmp_path, env={"ZEROMPI_CUDA_AWARE_MPI": "1"})
    assert all(i["cuda_aware"] is True for i in r)
