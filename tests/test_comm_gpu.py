"""Communication for GPU tensors (zerompi/comm/nccl.py, zerompi/comm/staged.py).

What runs everywhere: the host-staged MPI pipeline with CPU tensors standing in for
device memory (chunking, double-buffer order, results equal to the unstaged
communicator, bitwise where the arithmetic is the same) at N = 2 and 3, the backend
choice, and importing the NCCL module without cupy. The same staged body runs on CUDA
tensors, and the NCCL tests run, only where a GPU (and cupy with NCCL) exists; elsewhere
they skip saying why."""
import subprocess
import sys

import pytest
import torch

from gpu_backend import nccl_skip_reason
from mpirun import mpi_env, run_worker

STAGED = {"all_gather", "all_gather_inplace", "all_to_all", "reduce_scatter_ordered", "all_reduce_ordered",
          "gather", "gather_staged", "broadcast", "reduce_scatter_native", "all_reduce_native", "all_reduce_max",
          "double_buffer_order", "stats", "split", "choices"}


NO_GPU = not torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(NO_GPU, reason="no CUDA device visible (torch.cuda.is_available() is False)")


@pytest.mark.parametrize("n", [2, 3])
def test_staged_collectives_on_cpu(n, tmp_path):
    r = run_worker(n, "comm_staged", ["--device", "cpu"], tmp_path, timeout=180)
    assert r["ok"] and r["world"] == n
    assert set(r["checks"]) == STAGED, sorted(STAGED ^ set(r["checks"]))
    assert r["pipeline"]["chunks"] >= 3  # the order check saw several chunks


def test_engine_over_staged_mpi_on_cpu(tmp_path):
    """Stages 0-3 over host-staged MPI (CPU tensors standing in for device memory): the
    same losses, full_state_dict() and full_grads() as over plain MPI, bitwise; stage 3's
    consolidation gathers through the staging slots (on a GPU, mpi.py would refuse); a
    checkpoint and load_full_state_dict restore the weights over staged MPI too."""
    r = run_worker(2, "staged_engine", [], tmp_path, timeout=240)
    assert r["stage3"]["gathers"] > 0 and r["stage3"]["consolidation_staged_steps"] > 0, r
    for stage in range(4):
        assert {"all_reduce", "broadcast"} <= set(r[f"stage{stage}"]["ops"]), r


def test_staged_communicator_stages_every_tensor_collective():
    """Each collective of the protocol that takes tensors (what the engine, checkpoints
    and export call) is StagedMPICommunicator's own: the inherited MPI one refuses
    device tensors when MPI is not CUDA-aware (stage 3's full_state_dict gathers)."""
    import inspect

    from zerompi.comm.base import Communicator
    from zerompi.comm.staged import StagedMPICommunicator

    takes_tensors = [name for name, f in vars(Communicator).items() if inspect.isfunction(f)
                     and {"t", "send", "recv"} & set(inspect.signature(f).parameters)]
    assert {"all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "gather"} <= set(takes_tensors)
    assert [n for n in takes_tensors if n not in vars(StagedMPICommunicator)] == []


@needs_gpu
@pytest.mark.parametrize("n", [2, 3])
def test_staged_collectives_on_gpu(n, tmp_path):
    """The same body on CUDA tensors: pinned slots, copies on a side stream; the ranks
    share the GPU(s) (device = rank mod GPUs), as host-staged MPI allows."""
    r = run_worker(n, "comm_staged", ["--device", "cuda"], tmp_path, timeout=300)
    assert set(r["checks"]) == STAGED, sorted(STAGED ^ set(r["checks"]))


def test_nccl_module_imports_without_cupy():
    code = ("import sys; sys.modules['cupy'] = None\n"  # any `import cupy` now fails
            "import zerompi.comm.nccl as m, zerompi.comm as c\n"
            "why = m.unavailable('cuda'); assert why and 'cupy' in why, why\n"
            "assert m.NCCL_DTYPES[__import__('torch').bfloat16] == 9\n"
            "try:\n    c.create(backend='nccl')\nexcept ValueError as e:\n"
            "    assert \"config key 'comm.backend' = 'nccl'\" in str(e) and 'cupy' in str(e), e\n"
            "else:\n    raise SystemExit('no error')\n")
    r = subprocess.run([sys.executable, "-c", code], env=mpi_env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-3000:]


def test_nccl_dtype_map_matches_cupy():
    nccl = pytest.importorskip("cupy.cuda.nccl", reason="cupy is not installed")
    from zerompi.comm.nccl import NCCL_DTYPES

    for name, dt in [("NCCL_FLOAT16", torch.float16), ("NCCL_FLOAT32", torch.float32),
                     ("NCCL_FLOAT64", torch.float64), ("NCCL_INT32", torch.int32), ("NCCL_INT64", torch.int64),
                     ("NCCL_BFLOAT16", torch.bfloat16)]:
        if hasattr(nccl, name):
            assert getattr(nccl, name) == NCCL_DTYPES[dt], name


def test_nccl_where_it_cannot_run_is_a_config_error():
    why = nccl_skip_reason()
    if why is None:
        pytest.skip("NCCL can run here")
    import zerompi.comm

    with pytest.raises(ValueError, match="config key 'comm.backend' = 'nccl'"):
        zerompi.comm.create(backend="nccl")


@needs_gpu
def test_nccl_collectives_one_rank_per_gpu(tmp_path):
    why = nccl_skip_reason()
    if why:
        pytest.skip(why)
    n = min(torch.cuda.device_count(), 2)
    r = run_worker(n, "comm_nccl", [], tmp_path, timeout=300)
    assert set(r["checks"]) == {"collectives", "bf16", "stream_order", "deadline_abort"}, r
