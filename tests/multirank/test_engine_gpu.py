"""The engine on a GPU: the CPU parity suite's bodies with the model on cuda, and no
device-wide synchronise inside a step. Skips without a CUDA device.

N = 1 uses NCCL when cupy is installed; N = 2-3 share the one GPU, which NCCL does not
allow, so comm.backend auto takes MPI on device buffers (host-staged with pip's MPICH).
Tolerances are the CPU suite's (test_parity.py): the reference runs on the same GPU."""
import pytest

from mpirun import run_worker
from parity_checks import check_fp32

pytestmark = pytest.mark.usefixtures("cuda")  # skips without a CUDA device


def _has_cupy() -> bool:
    try:
        import cupy  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.parametrize("n", [1, 2, 3])
def test_gpu_fp32_parity(n, tmp_path):
    args = ["--model", "odd", "--clip", "0.05", "--device", "cuda"]
    if n == 1 and _has_cupy():
        args += ["--backend", "nccl"]
    r = run_worker(n, "parity", args, tmp_path, timeout=600)
    check_fp32(r)
    for stage in range(4):
        d = r[f"stage{stage}"]
        assert all(x.startswith("cuda") for x in d["devices"]), d["devices"]  # nothing left on the host
        if n == 1 and _has_cupy():
            assert d["backend"] == "NCCLCommunicator", d["backend"]
            assert d["optimizer"] == "FusedShardAdamW", d["optimizer"]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_gpu_low_precision_tracks_fp32(precision, tmp_path):
    r = run_worker(2, "parity", ["--model", "gpt", "--precision", precision, "--lr", "1e-2",
                                 "--device", "cuda"], tmp_path, timeout=600)
    ref = r["ref_losses"]
    assert abs(ref[-1] - ref[0]) > 0.03 or max(ref) - min(ref) > 0.03
    for stage in range(4):
        dev = max(abs(a - b) for a, b in zip(r[f"stage{stage}"]["losses"], ref))
        assert dev < 0.03, (stage, dev)


def test_gpu_step_has_no_device_synchronise(tmp_path):
    """The profiler sees every CUDA runtime call: no cudaDeviceSynchronize in a step."""
    r = run_worker(1, "gpu_sync", [], tmp_path, timeout=600)
    for stage in range(4):
        d = r[f"stage{stage}"]
        assert d["device_syncs"] == 0, (stage, d)


def test_gpu_offloaded_optimizer_parity(tmp_path):
    """ZeRO-Offload on a GPU: master and moments in pinned host memory, the update on the
    host, parameters and gradients on the device; parity as on the CPU."""
    r = run_worker(1, "parity", ["--model", "odd", "--clip", "0.05", "--device", "cuda",
                                 "--offload", "cpu"], tmp_path, timeout=600)
    check_fp32(r)
    for stage in range(4):
        d = r[f"stage{stage}"]
        assert d["offloaded"] > 0 and d["master_device"] == "cpu", d
