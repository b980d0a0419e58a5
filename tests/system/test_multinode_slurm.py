"""Training across two simulated nodes, 4 ranks, launched two ways:
- slurm/multinode-ib.sbatch, unchanged, with only the site knobs of the "Ethernet / TCP"
  variant (slurm/README.md) in the environment: it trains, checkpoints on SIGUSR1,
  requeues itself, and the requeued run resumes;
- mpiexec with a host list: uninterrupted, and stopped by SIGUSR1 at another step and
  launched again.
All three end bitwise equal: losses, gradient norms and every saved state."""
from __future__ import annotations

import os
import signal
import subprocess

from mpirun import mpi_env
from multinode_jobs import (REPO, SITE_ENV, checkpoint_states, metrics, same_states, train_argv,
                            train_mpiexec, wait_steps, write_config)
from slurm_jobs import _diag, _read, wait_requeued
from test_slurm_templates import _in_order

TEMPLATE = REPO / "slurm" / "multinode-ib.sbatch"
MORE = 12  # steps trained after the signal's checkpoint (a second stop lands ~5 steps late under load)


def test_template_trains_checkpoints_requeues_resumes_bitwise(net_slurm, net_nodes, tmp_path):
    cfg = write_config(tmp_path / "fast.toml", max_steps=1_000_000)  # stopped by the signal
    run_dir, log = tmp_path / "run", tmp_path / "job.log"
    # the template's default launch (MPI_TYPE=auto: MPICH's mpiexec across nodes)
    env = {k: v for k, v in SITE_ENV.items() if k != "MPI_TYPE"}
    job_id = net_slurm.sbatch(TEMPLATE, cwd=REPO, env={**env, "CONFIG": str(cfg), "RUN_DIR": str(run_dir)},
                              options=["--nodes=2", "--ntasks-per-node=2", f"--output={log}"])
    why = lambda: _diag(net_slurm, job_id, log)  # noqa: E731
    wait_steps(run_dir, 3, lambda: net_slurm.state(job_id) in ("PENDING", "RUNNING", "CONFIGURING"), why=why)
    # As --signal=B:USR1 would, at once: the batch shell relays it to srun and the ranks.
    net_slurm.run(["scancel", "--batch", "--signal=USR1", str(job_id)])
    info = wait_requeued(net_slurm, job_id, timeout=90)
    assert info.get("JobState") == "PENDING", why()
    k = len(metrics(run_dir))
    write_config(cfg, max_steps=k + MORE)  # read by the requeued run (~10 s of cred_expire away)
    assert net_slurm.state(job_id) == "PENDING", why()
    assert net_slurm.wait(job_id, timeout=150) == "COMPLETED", why()

    text = _read(log)
    _in_order(text, [
        r"restart 0: 4 ranks on 2 nodes \(\S+\), device cpu, .*UCX_NET_DEVICES=eth0 UCX_TLS=tcp,sm,self",
        r"restart 0: running: mpiexec -bootstrap slurm -n 4 -ppn 2 \S+ -m zerompi\.train ",
        rf"^zerompi\.train: 4 ranks on 2 nodes \(2 per node\): {net_nodes.nodes[0]} \(ranks 0-1\), "
        rf"{net_nodes.nodes[1]} \(ranks 2-3\)",
        r"restart 0: USR1 \(time limit near\): relaying to the ranks",
        rf"^zerompi\.train: SIGUSR1 received: checkpoint of step {k} saved",
        r"restart 0: checkpointed; requeueing",
        r"^zerompi\.train: 4 ranks on 2 nodes \(2 per node\)",
        rf"^zerompi\.train: run_dir \S+; resumed at step {k}\b",
        rf"^zerompi\.train: done, {k + MORE} steps",
        r"restart 1: srun exited with 0",
    ], why())

    # The same config uninterrupted, launched by mpiexec with a host list on the same nodes.
    ref = tmp_path / "ref"
    r = train_mpiexec(net_nodes, cfg, ref)
    assert r.returncode == 0, r.stdout[-3000:]
    assert "zerompi.train: 4 ranks on 2 nodes (2 per node)" in r.stdout, r.stdout[-3000:]
    stopped = tmp_path / "stopped"
    k2 = _mpiexec_stopped_and_resumed(net_nodes, tmp_path / "fast2.toml", stopped, k + MORE, avoid=k)
    want = metrics(ref)
    assert [m["step"] for m in want] == list(range(1, k + MORE + 1))
    for run, at in ((run_dir, k), (stopped, k2)):
        got = metrics(run)
        assert [m["step"] for m in got] == list(range(1, k + MORE + 1)), (run, got)
        assert [m["loss"] for m in got] == [m["loss"] for m in want], (run, at, got, want)
        assert [m["grad_norm"] for m in got] == [m["grad_norm"] for m in want], (run, at)
        assert same_states(checkpoint_states(run), checkpoint_states(ref)) == [], (run, at)
    # The first save checked that both nodes see the run directory, and left no marker.
    assert not list((run_dir / "checkpoints").glob("*/.node-*")), list((run_dir / "checkpoints").rglob("*"))


def _mpiexec_stopped_and_resumed(net, cfg, run_dir, max_steps: int, avoid: int) -> int:
    """mpiexec across the nodes, SIGUSR1 to mpiexec (it forwards it to every rank) once
    step `avoid` + 1 is done (so the checkpoint is at another step than the Slurm job's),
    then the same command again to max_steps; returns the step of the checkpoint."""
    write_config(cfg, max_steps=1_000_000)
    p = subprocess.Popen(net.mpiexec_argv(ppn=2) + train_argv(cfg, run_dir), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, env=mpi_env(), cwd=REPO, start_new_session=True)
    try:
        wait_steps(run_dir, avoid + 1, lambda: p.poll() is None)
        p.send_signal(signal.SIGUSR1)
        out = p.communicate(timeout=120)[0]
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
    assert p.returncode == 124, out[-3000:]
    k2 = len(metrics(run_dir))
    assert f"SIGUSR1 received: checkpoint of step {k2} saved" in out and avoid < k2 < max_steps, out[-3000:]
    write_config(cfg, max_steps=max_steps)
    r = train_mpiexec(net, cfg, run_dir)
    assert r.returncode == 0 and f"resumed at step {k2}" in r.stdout, r.stdout[-3000:]
    return k2
