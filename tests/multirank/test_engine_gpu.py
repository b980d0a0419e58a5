"""The engine on a GPU: the CPU parity suite's bodies with the model on cuda, and no
device-wide synchronise inside a step. Skips without a CUDA device.

N = 1 uses NCCL, and skips with the engine's own reason (support/gpu_backend.py) where NCCL
cannot run; N = 2-3 share the one GPU, which NCCL does not allow, so comm.backend auto
takes MPI on device buffers (host-staged with pip's MPICH).
Tolerances are the CPU suite's (tests/multirank/test_parity.py): the reference runs on the same GPU."""
import pytest

from gpu_backend import nccl_skip_reason
from mpirun import run_worker
from parity_checks import check_fp32

pytestmark = pytest.mark.usefixtures("cuda")  # skips without a CUDA device


@pytest.mark.parametrize("n,backend", [(1, "nccl"), (2, "auto"), (3, "auto")])
def test_gpu_fp32_parity(n, backend, tmp_path):
    if backend == "nccl" and nccl_skip_reason():
        pytest.skip(nccl_skip_reason())
    args = ["--model", "odd", "--clip", "0.05", "--device", "cuda", "--backend", backend]
    r = run_worker(n, "parity", args, tmp_path, timeout=600)
    check_fp32(r)
    for stage in range(4):
        d = r[f"stage{stage}"]
        assert all(x.startswith("cuda") for x in d["devices"]), d["devices"]  # nothing left on the host
        if backend == "nccl":
            assert d["backend"] == "NCCLCommunicator", d["backend"]
            assert d["optimizer"] == "FusedShardAdamW", d["optimizer"]
        else:  # ranks share the GPU: MPI on device buffers (staged with pip's MPICH)
            assert d["backend"] in ("StagedMPICommunicator", "MPICommunicator"), d["backend"]


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
        assert d["ranges"] == 1 and d["device_syncs"] == 0, (stage, d)
        # bf16 with the fused optimizer: the norm is read a step late, so no stream waits
        # either (event waits only, on work a step old: zero/step_coef.py)
        if d["optimizer"] == "FusedShardAdamW":
            assert d["defer_stats"] and d["syncs"].get("cudaStreamSynchronize", 0) == 0, (stage, d)


def test_gpu_offloaded_optimizer_parity(tmp_path):
    """ZeRO-Offload on a GPU: master and moments in pinned host memory, the update on the
    host, parameters and gradients on the device; parity as on the CPU."""
    r = run_worker(1, "parity", ["--model", "odd", "--clip", "0.05", "--device", "cuda",
                                 "--offload", "cpu"], tmp_path, timeout=600)
    check_fp32(r)
    for stage in range(4):
        d = r[f"stage{stage}"]
        assert d["offloaded"] > 0 and d["master_device"] == "cpu", d
