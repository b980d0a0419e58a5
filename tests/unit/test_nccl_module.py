"""The NCCL backend where it cannot run: its module imports without cupy, its dtype
codes are cupy's, and asking for it is a config error naming the key (GPU runs:
tests/multirank/test_comm_gpu.py)."""
import subprocess
import sys

import pytest
import torch

from gpu_backend import nccl_skip_reason
from mpirun import mpi_env


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


def test_nccl_handle_lets_go_of_its_buffers_after_wait():
    """After wait() (torch's stream ordered after the collective, which may still run),
    test() keeps polling the completion event and drops the buffers once it fired:
    found on an H100, where the handle held them for its whole life."""
    from types import SimpleNamespace

    from zerompi.comm.base import CommStats
    from zerompi.comm.nccl import _NcclHandle

    ev = SimpleNamespace(fired=False)
    ev.query = lambda: ev.fired
    h = _NcclHandle(SimpleNamespace(_stats=CommStats()), "all_reduce", ev, (torch.zeros(2),))
    assert not h.test() and h.keep
    h.done = True  # what wait() leaves: ordered, not necessarily finished
    assert h.test() and h.keep, "buffers dropped before the event fired"
    ev.fired = True
    assert h.test() and h.keep == ()
