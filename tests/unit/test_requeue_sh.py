"""slurm/_requeue.sh's decisions without a Slurm: the launch line each MPI_TYPE gives,
and MAX_RESTARTS counting restarts after failures, not the template's own time-limit
requeues (the templates on a real Slurm: tests/system/test_slurm_templates.py)."""
import subprocess
from pathlib import Path

import pytest

HELPER = Path(__file__).resolve().parents[2] / "slurm" / "_requeue.sh"


def bash(script: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", f'set -u; . "{HELPER}"; {script}'], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", **env}, timeout=30)


@pytest.mark.parametrize("env,line", [
    ({"SLURM_JOB_NUM_NODES": "1"}, "srun --mpi=pmi2 --kill-on-bad-exit=1"),
    ({"SLURM_JOB_NUM_NODES": "2", "SLURM_NTASKS": "4", "SLURM_NTASKS_PER_NODE": "2(x2)"},
     "mpiexec -bootstrap slurm -n 4 -ppn 2"),
    ({"SLURM_JOB_NUM_NODES": "2", "SLURM_NTASKS": "3"}, "mpiexec -bootstrap slurm -n 3"),
    ({"SLURM_JOB_NUM_NODES": "4", "MPI_TYPE": "pmix"}, "srun --mpi=pmix --kill-on-bad-exit=1"),
    ({"SLURM_JOB_NUM_NODES": "1", "MPI_TYPE": "hydra", "SLURM_NTASKS": "2"}, "mpiexec -bootstrap slurm -n 2"),
])
def test_launch_line(env, line):
    r = bash('zerompi_launcher; echo "${ZEROMPI_LAUNCH[*]}"', env)
    assert r.returncode == 0 and r.stdout.strip() == line, r


def test_startup_deadline_exported():
    r = bash('echo "$ZEROMPI_STARTUP_TIMEOUT_S"', {})
    assert r.stdout.strip() == "300"
    r = bash('echo "$ZEROMPI_STARTUP_TIMEOUT_S"', {"ZEROMPI_STARTUP_TIMEOUT_S": "60"})
    assert r.stdout.strip() == "60"


def test_time_limit_requeues_are_not_failures(tmp_path):
    """Three requeues at the time limit (noted by zerompi_requeue_or_exit; scontrol
    stubbed), then restart 4 after a node failure: one failure; MAX_RESTARTS=0 stops
    the next run, the default lets it start."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    env = {"SLURM_JOB_ID": "77", "RUN_DIR": str(run_dir)}
    for restart in range(3):
        r = bash("scontrol() { return 0; }; zerompi_requeue_or_exit 124", {**env, "SLURM_RESTART_COUNT": str(restart)})
        assert r.returncode == 0 and "checkpointed; requeueing" in r.stdout, r
    (run_dir / ".slurm-requeues").open("a").write("76 1\n")  # an older job's: not this one's
    r = bash("zerompi_failed_restarts", {**env, "SLURM_RESTART_COUNT": "3"})
    assert r.stdout.strip() == "0", r
    r = bash("zerompi_failed_restarts", {**env, "SLURM_RESTART_COUNT": "4"})
    assert r.stdout.strip() == "1", r
    r = bash("zerompi_run true; echo ran $ZEROMPI_RC", {**env, "SLURM_RESTART_COUNT": "4", "MAX_RESTARTS": "0"})
    assert r.returncode == 1 and "not starting: 1 restarts after failures (MAX_RESTARTS=0)" in r.stdout, r
    assert "ran" not in r.stdout
    r = bash("zerompi_run true; echo ran $ZEROMPI_RC", {**env, "SLURM_RESTART_COUNT": "13"})
    assert r.returncode == 0 and "ran 0" in r.stdout, r  # 13 restarts, 10 of them failures: the default allows it


@pytest.mark.parametrize("dead,said", [
    ("n2", "the launcher ended the job (exit 255); lost: node n2 (1 of 3 did not run a probe step within 5 s"),
    ("", "the launcher ended the job (exit 255); every node of the job answers: a process died on a live node"),
])
def test_a_launcher_ending_names_the_nodes_that_do_not_answer(dead, said, tmp_path):
    """A node's processes killed: hydra ends the job (exit 255) naming nobody. The
    script probes each node with a step (srun and scontrol stubbed: node `dead`'s probe
    fails) and names the silent one, then waits for Slurm's verdict as after exit 3;
    every node answering means a crash on a live node: no wait, the launcher's code."""
    (tmp_path / "scontrol").write_text('#!/bin/sh\n[ "$1 $2" = "show hostnames" ] && printf "n1\\nn2\\nn3\\n"\n')
    (tmp_path / "srun").write_text(f'#!/bin/sh\nfor a; do [ "$a" = "--nodelist={dead}" ] && exit 1; done\nexit 0\n')
    for f in ("scontrol", "srun"):
        (tmp_path / f).chmod(0o755)
    r = bash("zerompi_requeue_or_exit 255",  # as after a launch that never ran zerompi_run too
             {"PATH": f"{tmp_path}:/usr/bin:/bin", "SLURM_JOB_NUM_NODES": "3", "SLURM_JOB_NODELIST": "n[1-3]",
              "ZEROMPI_PROBE_S": "5", "LOST_NODE_WAIT": "0"})
    assert r.returncode == 255 and said in r.stdout, r
    assert ("waiting up to 0 s for Slurm to declare a node down" in r.stdout) == bool(dead), r
