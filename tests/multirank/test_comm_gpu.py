"""Communication for GPU tensors (zerompi/comm/nccl.py, zerompi/comm/staged.py).

What runs everywhere: the host-staged MPI pipeline with CPU tensors standing in for
device memory (chunking, double-buffer order, results equal to the unstaged
communicator, bitwise where the arithmetic is the same) at N = 2 and 3. The same staged
body runs on CUDA tensors, and the NCCL tests run, only where a GPU (and cupy with NCCL)
exists (the `cuda` fixture); elsewhere they skip saying why. The NCCL module where it
cannot run: tests/unit/test_nccl_module.py."""
import pytest
import torch

from batch import batched, worker
from gpu_backend import nccl_skip_reason
from mpirun import run_worker

STAGED = {"all_gather", "all_gather_inplace", "all_to_all", "reduce_scatter_ordered", "all_reduce_ordered",
          "gather", "gather_staged", "broadcast", "reduce_scatter_native", "all_reduce_native", "all_reduce_max",
          "double_buffer_order", "stats", "split", "choices"}


@batched(lambda n: worker(n, "comm_staged", "--device", "cpu"))
@pytest.mark.parametrize("n", [2, 3])
def test_staged_collectives_on_cpu(n, result):
    r = result
    assert r["ok"] and r["world"] == n
    assert set(r["checks"]) == STAGED, sorted(STAGED ^ set(r["checks"]))
    assert r["pipeline"]["chunks"] >= 3  # the order check saw several chunks


@batched(lambda: worker(2, "staged_engine", timeout=240))
def test_engine_over_staged_mpi_on_cpu(result):
    """Stages 0-3 over host-staged MPI (CPU tensors standing in for device memory): the
    same losses, full_state_dict() and full_grads() as over plain MPI, bitwise; stage 3's
    consolidation gathers through the staging slots (on a GPU, mpi.py would refuse); a
    checkpoint and load_full_state_dict restore the weights over staged MPI too."""
    r = result
    assert r["stage3"]["gathers"] > 0 and r["stage3"]["consolidation_staged_steps"] > 0, r
    for stage in range(4):
        assert {"all_reduce", "broadcast"} <= set(r[f"stage{stage}"]["ops"]), r


@pytest.mark.parametrize("n", [2, 3])
def test_staged_collectives_on_gpu(n, tmp_path, cuda):
    """The same body on CUDA tensors: pinned slots, copies on a side stream; the ranks
    share the GPU(s) (device = rank mod GPUs), as host-staged MPI allows."""
    r = run_worker(n, "comm_staged", ["--device", "cuda"], tmp_path, timeout=300)
    assert set(r["checks"]) == STAGED, sorted(STAGED ^ set(r["checks"]))


def test_nccl_collectives_one_rank_per_gpu(tmp_path, cuda):
    why = nccl_skip_reason()
    if why:
        pytest.skip(why)
    n = min(torch.cuda.device_count(), 2)
    r = run_worker(n, "comm_nccl", [], tmp_path, timeout=300)
    assert set(r["checks"]) == {"collectives", "bf16", "stream_order", "deadline_abort"}, r
