"""runtime/startup.py in this process: the deadline's sources, the launch-mismatch line,
and the watcher that ends a process stuck past its deadline (a stand-in for MPI_Init:
a child that sleeps 30 s with a SIGTERM handler that only sets a flag, as the train
command's). The launches: tests/system/test_launch.py."""
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from zerompi.config import CommConfig
from zerompi.runtime import startup

SLURM_NONE = {"SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_NTASKS": "2", "SLURM_MPI_TYPE": "none"}


def test_default_deadline_is_the_config_keys():
    assert startup.DEFAULT_TIMEOUT_S == CommConfig().startup_timeout_s


def test_deadline_sources(monkeypatch):
    monkeypatch.delenv(startup.ENV_TIMEOUT, raising=False)
    assert startup.timeout_s() == startup.DEFAULT_TIMEOUT_S
    assert startup.timeout_s(30) == 30.0  # the config's, when the caller read it
    monkeypatch.setenv(startup.ENV_TIMEOUT, "7.5")
    assert startup.timeout_s(30) == 7.5  # the launch's word wins: it is set for the whole job
    for bad in ("soon", "-1", "nan"):
        monkeypatch.setenv(startup.ENV_TIMEOUT, bad)
        with pytest.raises(ValueError, match=f"{startup.ENV_TIMEOUT}='{bad}'"):
            startup.timeout_s()


@pytest.mark.parametrize("env,want", [
    ({**SLURM_NONE, "SLURM_PROCID": "1"}, "srun --mpi=none"),
    ({"SLURM_STEP_ID": "3", "SLURM_STEP_NUM_TASKS": "4"}, "srun --mpi=none (no PMI or PMIx variables)"),
    ({"SLURM_STEP_ID": "3", "PMI_FD": "5"}, "srun (SLURM_MPI_TYPE unset)"),
    ({"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "0"}, "Open MPI's mpirun"),
    ({"PMI_RANK": "0", "PMI_SIZE": "2", "PMI_FD": "9"}, "mpiexec/hydra"),
    ({}, "no launcher"),
])
def test_launcher_named(env, want):
    assert startup.launcher(env).startswith(want) or want in startup.launcher(env)


def test_mismatch_only_for_a_world_of_one_in_a_bigger_launch():
    line = startup.mismatch(1, SLURM_NONE)
    assert "started 2 tasks (SLURM_STEP_NUM_TASKS=2, launcher srun --mpi=none)" in line
    assert "world of 1 rank" in line and "--mpi=pmi2" in line
    assert startup.mismatch(2, SLURM_NONE) is None  # srun --mpi=pmi2: one world of 2
    assert startup.mismatch(1, {"SLURM_STEP_NUM_TASKS": "1"}) is None
    assert startup.mismatch(1, {}) is None  # a plain `python` (MPI singleton)
    assert "OMPI_COMM_WORLD_SIZE=4" in startup.mismatch(1, {"OMPI_COMM_WORLD_SIZE": "4"})


def test_only_the_launchers_rank_0_speaks():
    assert startup.env_rank({"SLURM_PROCID": "0"}) == 0
    assert startup.env_rank({"PMI_RANK": "3"}) == 3
    assert startup.env_rank({}) is None


def test_stall_line_names_launcher_variables_and_library():
    line = startup.stall_line(5, env={**SLURM_NONE, "PMI_FD": "7"})
    assert line.startswith("zerompi: error: MPI did not start within 5 s")
    assert "launcher srun --mpi=none" in line and "PMI_FD=7" in line and "SLURM_MPI_TYPE=none" in line
    assert "MPI library" in line and "Try:" in line and "\n" not in line


def _stuck(seconds, then_done: bool):
    """A process that starts a Guard, then blocks in C for 30 s (or calls done() first)."""
    code = textwrap.dedent(f"""
        import signal, sys, time
        sys.path.insert(0, {str(Path(startup.__file__).parents[2])!r})
        from zerompi.runtime import startup
        signal.signal(signal.SIGTERM, lambda *a: None)  # as the train command's stop handlers
        g = startup.Guard({seconds})
        if {then_done}:
            g.done()
            print("done", flush=True)
        time.sleep(1.5 if {then_done} else 30)
    """)
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    return res, time.monotonic() - t0


def test_guard_ends_a_stuck_process_with_one_line():
    res, took = _stuck(1.0, then_done=False)
    assert res.returncode == -9, res
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("zerompi: error: MPI did not start within 1 s"), res.stderr
    assert took < 6, took


def test_guard_done_in_time_leaves_nothing():
    res, took = _stuck(0.5, then_done=True)
    assert res.returncode == 0 and res.stdout == "done\n" and res.stderr == "", res
    assert took >= 1.5  # lived past the deadline: the watcher had gone quietly


def test_engine_keys_are_named_as_typed_on_the_command_line():
    """A ConfigError the engine raises late (train.py re-raises it for the abort hook's
    one line) names ZeroConfig keys under `zero.`, the trainer's own as they are."""
    from zerompi.config import ConfigError
    from zerompi.train import zero_key

    assert zero_key(ConfigError("offload.pipeline", "staged", "x")).key == "zero.offload.pipeline"
    assert zero_key(ConfigError("shard_group", 3, "x")).key == "zero.shard_group"
    assert zero_key(ConfigError("device", "cuda", "x")).key == "device"
    assert zero_key(ConfigError("checkpoint_interval", 0, "x")).key == "checkpoint_interval"
