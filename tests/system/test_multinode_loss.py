"""A node lost mid-step (tests/support/netcluster.py): its link goes down and every process on
it (slurmd, MPI proxy, ranks) is SIGKILLed, as when a node loses power. The surviving
ranks' watchdog ends the run within zero.comm.timeout_s + 3 s of asking (twice if the
loss lands in a checkpoint save), naming the lost node's ranks and host; the batch script
keeps the allocation until Slurm declares the node down and requeues the job
(slurm/_requeue.sh). A requeued job keeps its size,
and this cluster has no spare node, so it is resubmitted on the node that remains with
the same run directory (what an operator does): it resumes from the last checkpoint,
4 ranks -> 2 (resharded), and continues the loss curve.

One more fault once (tests/support/node_loss.py; cancelled instead of waiting for Slurm's
requeue): a power loss while a background checkpoint write is in flight (it is never
published; the resume takes the one before). The link cut alone (the cut-off node's
ranks end by their own watchdog), kill with the link up, and every fault repeated at
timeout_s 8 and 60: tests/system/test_node_loss_soak.py (`-m soak`; the suite's budget
has room for one more run of the bed, not four)."""
from __future__ import annotations

import re
import time

import pytest

from multinode_jobs import REPO, SITE_ENV, metrics, wait_steps, write_config
from slurm_jobs import _diag, _read, wait_requeued

TEMPLATE = REPO / "slurm" / "multinode-ib.sbatch"
TIMEOUT_S = 8  # zero.comm.timeout_s of the job
# Steps are short here and a save comes every CKPT steps, so the loss lands in a save
# about half the time: there the others wait under startup_timeout_s (for slow writers),
# but ask after timeout_s, and ranks silent twice end the job (3 s more).
SLURMD_TIMEOUT_S = 30  # Slurm declares the node down after the watchdog has spoken
CKPT = 4       # checkpoint_interval


@pytest.fixture
def cluster():
    """Its own two nodes: this test kills one."""
    from netcluster import NetCluster, available
    from netslurm import NetSlurm
    from slurm_cluster import slurm_available

    for ok, why in (available(), slurm_available()):
        if not ok:
            pytest.skip(why)
    # Slurm must not declare the node down (and end the job's steps) before the watchdog
    # has spoken, at the deadline + 3 s of asking.
    with NetCluster(nodes=2, rate_mbit=None) as net, NetSlurm(net, slurmd_timeout=SLURMD_TIMEOUT_S) as slurm:
        yield net, slurm


def test_node_lost_mid_step_ends_naming_it_and_resumes_on_the_rest(cluster, tmp_path):
    net, slurm = cluster
    lost = net.nodes[1]
    settings = {"top": f"checkpoint_interval = {CKPT}\n", "zero": f"comm = {{ timeout_s = {TIMEOUT_S} }}\n"}
    cfg = write_config(tmp_path / "fast.toml", max_steps=1_000_000, **settings)
    run_dir, log = tmp_path / "run", tmp_path / "job.log"
    job_id = slurm.sbatch(TEMPLATE, cwd=REPO, env={**SITE_ENV, "CONFIG": str(cfg), "RUN_DIR": str(run_dir)},
                          options=["--nodes=2", "--ntasks-per-node=2", f"--output={log}"])
    why = lambda: _diag(slurm, job_id, log)  # noqa: E731
    wait_steps(run_dir, CKPT + 2, lambda: slurm.state(job_id) in ("PENDING", "RUNNING", "CONFIGURING"), why=why)
    assert "4 ranks on 2 nodes (2 per node)" in _read(log), why()

    net.link_down(lost)  # first the link, so nothing of the dying processes gets out
    killed = net.kill_node(lost)
    t_lost = time.monotonic()
    assert killed, "no process on the lost node"
    before = metrics(run_dir)  # steps trained on 4 ranks, some past the checkpoint
    watchdog = None
    while watchdog is None and time.monotonic() - t_lost < TIMEOUT_S + 30:
        m = re.search(r"^\[rank [01]\] zerompi watchdog: .*$", _read(log), re.M)
        watchdog = m and (m.group(0), time.monotonic() - t_lost)
        time.sleep(0.1)
    assert watchdog, "no watchdog message within the deadline" + why()
    line, seconds = watchdog
    print(f"watchdog after {seconds:.1f} s: {line}")
    in_save = "during checkpoint save" in line
    # Deadline + 3 s of asking (twice in a save) + one step in flight + polling.
    assert seconds < TIMEOUT_S + 3 * (1 + in_save) + 6, line
    assert f"not complete after {TIMEOUT_S} s (zero.comm.timeout_s" in line, line
    assert f"ranks 2-3 (all of node {lost}) did not answer" in line, line

    info = wait_requeued(slurm, job_id, timeout=SLURMD_TIMEOUT_S + 40)
    assert info.get("JobState") == "PENDING" and info.get("Restarts") == "1", why()
    assert slurm.node_states()[lost].startswith("down"), slurm.node_states()
    assert f"waiting up to {SLURMD_TIMEOUT_S + 30} s for Slurm to declare a node down" in _read(log), why()
    slurm.run(["scancel", str(job_id)])
    # The last checkpoint published before the loss. It can be one step past the metrics:
    # a loss between a save's publication and that step's metrics line loses the line
    # (the resumed run writes it back from the checkpoint).
    k = int((run_dir / "checkpoints" / "latest").read_text().split("_")[-1])
    assert k % CKPT == 0 and len(before) - CKPT < k <= len(before) + 1, (k, len(before))
    write_config(cfg, max_steps=k + 6, **settings)
    job_id = slurm.sbatch(TEMPLATE, cwd=REPO, env={**SITE_ENV, "CONFIG": str(cfg), "RUN_DIR": str(run_dir)},
                          options=["--nodes=1", "--ntasks-per-node=2", f"--output={log}", "--open-mode=append"])
    assert slurm.wait(job_id, timeout=120) == "COMPLETED", why()

    text = _read(log)
    assert re.search(r"restart 0: 2 ranks on 1 nodes \(" + re.escape(net.nodes[0]), text), why()
    assert f"zerompi.train: 2 ranks on 1 node (2 per node): {net.nodes[0]} (ranks 0-1)" in text, why()
    assert re.search(rf"^zerompi\.train: run_dir \S+; resumed at step {k}\b", text, re.M), why()
    after = metrics(run_dir)
    kept = min(k, len(before))
    assert [m["step"] for m in after] == list(range(1, k + 7)), why()
    assert after[:kept] == before[:kept]  # the steps before the checkpoint are kept as they were
    # Steps redone on 2 ranks: the same global batch, summed in another order (fp32).
    redone = [(a["loss"], b["loss"]) for a, b in zip(after[k:], before[k:])]
    # (none when the loss came right after the save of step k)
    assert all(abs(a - b) <= 1e-4 * abs(b) for a, b in redone), redone
    assert after[-1]["loss"] < after[0]["loss"] - 1.0, after


def test_node_lost_during_a_background_write_ends_naming_it_and_resumes(tmp_path):
    fault = "async-write"
    from netcluster import available
    from node_loss import lose_node, summary
    from slurm_cluster import slurm_available

    for ok, why in (available(), slurm_available()):
        if not ok:
            pytest.skip(why)
    problems, facts = lose_node(fault, TIMEOUT_S, tmp_path)
    print(summary([(fault, TIMEOUT_S, problems, facts)]))
    assert not problems, "\n".join(problems)
