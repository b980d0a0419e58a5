"""Launches that went wrong before training could start (runtime/startup.py, train.py):
a process manager that never answers MPI_Init, a launcher whose N tasks became N
one-rank worlds, and config values only the world size, the node layout or the
hardware can refuse. Each ends with one line, within its deadline; all of them before
any rank imports torch (a `torch` that fails to import is first on the path), except
the cases that need torch to decide (nccl on a resolved device, the library path)."""
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from mpirun import ROOT, launch, mpi_env, run_mpi, torch_unimportable

TRAIN = [sys.executable, "-m", "zerompi.train", "--data", "default", "--max_steps", "2"]
LAUNCH_VARS = ("PMI_", "PMIX_", "SLURM_", "OMPI_", "HYDRA_", "MPI_LOCAL")


@pytest.fixture(scope="module")
def no_torch(tmp_path_factory):
    return torch_unimportable(tmp_path_factory.mktemp("no-torch"))


def bare_env(extra: dict) -> dict:
    """The test environment without any launcher's variables, plus `extra`."""
    env = {k: v for k, v in mpi_env().items() if not k.startswith(LAUNCH_VARS) and k != "ZEROMPI_STARTUP_TIMEOUT_S"}
    env.update(extra)
    return env


def start(cmd, env):
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True, cwd=ROOT)


def finish(p, timeout):
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        pytest.fail(f"still running after {timeout} s:\n{err[-3000:]}")
    return p.returncode, out, err


@pytest.mark.parametrize("how", ["env", "config"])
def test_mpi_init_that_never_returns_ends_at_the_deadline(tmp_path, no_torch, how):
    """A PMI server that accepts and never answers (MPICH's PMI-1 client then waits in
    MPI_Init forever): the guard prints its line and ends the rank at the deadline."""
    pmi = socket.socket()
    pmi.bind(("127.0.0.1", 0))
    pmi.listen(4)
    try:
        deadline = {"env": ({"ZEROMPI_STARTUP_TIMEOUT_S": "2"}, []),
                    "config": ({}, ["--zero.comm.startup_timeout_s", "2"])}[how]
        env = bare_env({"PMI_PORT": f"127.0.0.1:{pmi.getsockname()[1]}", "PMI_RANK": "0", "PMI_SIZE": "2",
                        "PMI_ID": "0", **no_torch, **deadline[0]})
        t0 = time.monotonic()
        rc, out, err = finish(start(TRAIN + ["--run_dir", str(tmp_path / "r")] + deadline[1], env), 60)
        took = time.monotonic() - t0
    finally:
        pmi.close()
    assert rc == -signal.SIGKILL, (rc, err[-3000:])
    assert err.splitlines() == [err.strip()], err  # one line, no traceback
    assert err.startswith("zerompi: error: MPI did not start within 2 s"), err
    assert "launcher a PMI-1 launcher (mpiexec/hydra)" in err and "PMI_PORT=127.0.0.1:" in err
    assert "MPI library " in err and "Try:" in err
    assert took < 2 + 8, took
    assert not (tmp_path / "r").exists()


def test_n_tasks_that_became_one_rank_worlds_are_named(tmp_path, no_torch):
    """`srun --mpi=none` (or another MPI's mpiexec): two processes of one launch, each
    in a world of its own, on the same run directory. One line from the launcher's rank
    0, exit 2 from both, before torch (formerly: the second found the run directory
    "in use by another job", exit 5, or both trained alone)."""
    slurm = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2",
             "SLURM_MPI_TYPE": "none", **no_torch}
    cmd = TRAIN + ["--run_dir", str(tmp_path / "r")]
    procs = [start(cmd, bare_env({**slurm, "SLURM_PROCID": str(i), "SLURM_LOCALID": str(i)})) for i in range(2)]
    results = [finish(p, 60) for p in procs]
    assert [rc for rc, _, _ in results] == [2, 2], results
    errs = "".join(err for _, _, err in results)
    assert "Traceback" not in errs and "in use by another job" not in errs, errs
    assert errs.splitlines() == [errs.strip()] and errs == results[0][2], errs  # rank 0's line only
    assert errs.startswith("zerompi.train: error: the launcher started 2 tasks (SLURM_STEP_NUM_TASKS=2, "
                           "launcher srun --mpi=none) but MPI gave each a world of 1 rank"), errs
    assert not (tmp_path / "r").exists()


def test_mismatch_in_a_users_own_program(tmp_path):
    """zerompi.runtime.init() (what zerompi.initialize's grid calls) in an Open MPI
    launch served by another MPI: one line, exit 2."""
    env = bare_env({"OMPI_COMM_WORLD_SIZE": "3", "OMPI_COMM_WORLD_RANK": "0"})
    rc, out, err = finish(start([sys.executable, "-c", "import zerompi; zerompi.runtime.init(); print('trained alone')"],
                                env), 60)
    assert rc == 2 and "trained alone" not in out, (rc, out, err)
    assert err.splitlines() == [err.strip()], err
    assert err.startswith("zerompi: error: the launcher started 3 tasks (OMPI_COMM_WORLD_SIZE=3"), err


NEEDS_LAYOUT = [  # (ranks, arguments, the line's key and reason)
    (["zero.stage=2", "zero.shard_group=3"], "'zero.shard_group' = 3: 3 ranks per group must divide the data-parallel size {n}"),
    (["zero.stage=3", "zero.stage3.secondary_partition=3"],
     "'zero.stage3.secondary_partition' = 3: must divide the data-parallel size {n}"),
    (["zero.stage=3", "zero.shard_group=node", "zero.stage3.secondary_partition=2"],
     "'zero.stage3.secondary_partition' = 2: a group of 2 ranks is not smaller than the shard group (2)"),
    (["zero.stage=2", "zero.shard_group=2", "zero.comm.hierarchical=on"],
     "'zero.comm.hierarchical' = 'on': two-level collectives are for shard_group \"world\""),
    (["zero.comm.backend=nccl", "--device", "cpu"],
     "'zero.comm.backend' = 'nccl': NCCL needs CUDA tensors, but device is cpu; use 'mpi' or 'auto'"),
]


def one_line(rc, out, err, needle):
    assert rc == 2, (rc, out[-2000:], err[-2000:])
    assert "Traceback" not in out + err, err
    assert err.splitlines() == [err.strip()] and err.startswith("zerompi.train: error: config key "), err
    assert needle in err, err


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("args,needle", NEEDS_LAYOUT, ids=["shard_group", "secondary", "secondary_node",
                                                             "hierarchical", "nccl_cpu"])
def test_keys_the_world_refuses_are_one_line_before_torch(tmp_path, no_torch, n, args, needle):
    # two ranks per node (ZEROMPI_RANKS_PER_NODE): shard_group "node" = 2 at both sizes
    res = launch(["mpiexec", "-n", str(n)] + TRAIN + ["--run_dir", str(tmp_path / "r")] + args, timeout=60,
                 env={"ZEROMPI_RANKS_PER_NODE": "2", **no_torch}, stderr_apart=True)
    one_line(res.returncode, res.stdout, res.stderr, needle.format(n=n))
    assert not (tmp_path / "r").exists()


def test_hierarchical_on_uneven_data_parallel_nodes(tmp_path, no_torch):
    """Three ranks per node, tp 2: each data-parallel group has 2 ranks on one node and 1
    on the other, which two-level collectives cannot split (the only layout error of
    comm.hierarchical; at 2 or 4 ranks no layout has it)."""
    res = launch(["mpiexec", "-n", "6"] + TRAIN + ["--run_dir", str(tmp_path / "r"), "zero.stage=2",
                 "zero.comm.hierarchical=on", "zero.tensor_parallel_size=2"], timeout=90,
                 env={"ZEROMPI_RANKS_PER_NODE": "3", **no_torch}, stderr_apart=True)
    one_line(res.returncode, res.stdout, res.stderr, "'zero.comm.hierarchical' = 'on': the data-parallel group has "
             "different numbers of ranks on its 2 nodes")


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="cupy is installed here")
@pytest.mark.parametrize("n", [2, 4])
def test_nccl_without_cupy_is_one_line_before_torch(tmp_path, no_torch, n):
    res = launch(["mpiexec", "-n", str(n)] + TRAIN + ["--run_dir", str(tmp_path / "r"), "zero.comm.backend=nccl"],
                 timeout=60, env=no_torch, stderr_apart=True)
    one_line(res.returncode, res.stdout, res.stderr, "'zero.comm.backend' = 'nccl': cupy is not installed")


def test_nccl_on_a_device_resolved_to_cpu_is_one_line(tmp_path):
    """device auto on a machine without a GPU resolves to cpu after torch is imported;
    a `cupy` that is found but cannot be imported passes the check before torch."""
    fake = tmp_path / "fake"
    (fake / "cupy").mkdir(parents=True)
    (fake / "cupy" / "__init__.py").write_text('raise ImportError("not this cupy")\n')
    if __import__("torch").cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    res = launch(["mpiexec", "-n", "2"] + TRAIN + ["--run_dir", str(tmp_path / "r"), "zero.comm.backend=nccl"],
                 timeout=90, env={"PYTHONPATH": os.pathsep.join([str(fake), str(ROOT)])}, stderr_apart=True)
    one_line(res.returncode, res.stdout, res.stderr, "'zero.comm.backend' = 'nccl': NCCL needs CUDA tensors, "
             "but the device is cpu; use 'mpi' or 'auto'")


LIBRARY = """
import torch, zerompi
model = torch.nn.Linear(8, 8)
engine = zerompi.initialize(model, {"stage": 2, "shard_group": 3})
print("built")
"""


def test_library_config_error_is_one_line_from_rank_0(tmp_path):
    """zerompi.initialize in a user's own loop: the ConfigError names the key as the
    user's dict has it; uncaught, it is one line from rank 0 and exit 2 (a caller may
    catch it, as a DeepSpeed user would catch deepspeed.initialize's errors)."""
    script = tmp_path / "own_loop.py"
    script.write_text(LIBRARY)
    res = run_mpi(4, [str(script)], timeout=120, module=False, check=False)
    assert res.returncode == 2, res.stdout[-3000:]
    assert "Traceback" not in res.stdout and "built" not in res.stdout, res.stdout[-3000:]
    needle = "zerompi: error: config key 'shard_group' = 3: 3 ranks per group must divide the data-parallel size 4"
    assert res.stdout.count("zerompi: error:") == 1 and needle in res.stdout, res.stdout[-3000:]


MPI_NONE = """\
#!/bin/bash
#SBATCH --ntasks=2
#SBATCH --time=2
# usage: sbatch this.sbatch PYTHON RUN_DIR
srun --mpi=none --kill-on-bad-exit=1 "$1" -m zerompi.train --data default --run_dir "$2"
echo "srun exited with $?"
"""


def test_srun_mpi_none_is_named_under_a_real_slurm(slurm_cluster, tmp_path, no_torch):
    """The real thing: `srun --mpi=none` with pip's MPICH gives two 1-rank worlds; the
    step ends with the mismatch line once (SLURM_PROCID 0) and exit 2."""
    from slurm_jobs import PY, _diag, _read, submit_mpi_job

    job_id, state, log, _ = submit_mpi_job(slurm_cluster, tmp_path, "mpinone", MPI_NONE,
                                           args=[PY, str(tmp_path / "r")], env=no_torch,
                                           timeout=90)
    text = _read(log)
    assert "srun exited with 2" in text, _diag(slurm_cluster, job_id, log)
    lines = [ln for ln in text.splitlines() if "zerompi.train: error" in ln]
    assert len(lines) == 1, text
    assert "the launcher started 2 tasks (SLURM_STEP_NUM_TASKS=2, launcher srun --mpi=none (no PMI or PMIx " \
        "variables)) but MPI gave each a world of 1 rank" in lines[0], text
    assert "Traceback" not in text and "in use by another job" not in text, text
