"""The simulated-node test bed itself (tests/support/netcluster.py, tests/support/netslurm.py): nodes
with their own host names whose ranks share memory inside a node and cross the shaped
link between nodes, under mpiexec and under Slurm; and a cleanup that leaves nothing
behind, also when the test process is interrupted."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mpirun import launch
from slurm_jobs import PY, _diag, submit_mpi_job

# Each rank: its host name, its shared-memory group, and one 4 MiB allreduce.
PROBE = """
import json, socket, sys
import numpy as np
from mpi4py import MPI
w = MPI.COMM_WORLD
node = w.Split_type(MPI.COMM_TYPE_SHARED, key=w.rank)
x = np.full(1 << 20, w.rank + 1.0, np.float32)
w.Allreduce(MPI.IN_PLACE, x)
rec = {"rank": w.rank, "host": socket.gethostname(), "node_size": node.size, "sum": float(x[0])}
with open(f"{sys.argv[1]}/rank{w.rank}.json", "w") as f:  # the shared filesystem
    json.dump(rec, f)
"""


def _probes(out: Path) -> dict[int, dict]:
    recs = [json.loads(p.read_text()) for p in out.glob("rank*.json")]
    return {r["rank"]: r for r in recs}


def _check_layout(recs: dict, nodes: list[str]) -> None:
    assert sorted(recs) == [0, 1, 2, 3], recs
    assert [recs[r]["host"] for r in range(4)] == [nodes[0], nodes[0], nodes[1], nodes[1]], recs
    assert all(r["node_size"] == 2 and r["sum"] == 10.0 for r in recs.values()), recs


def test_mpiexec_across_nodes_crosses_the_shaped_link(net_nodes, tmp_path):
    """mpiexec with a host list: 2 ranks per node, one host name per node, shared memory
    inside a node only, and the allreduce's data on the veth between the nodes."""
    net = net_nodes
    net.shape(net.nodes[0], rate_mbit=200)
    try:
        before = net.link_bytes()
        r = launch(net.mpiexec_argv(ppn=2) + [PY, "-c", PROBE, str(tmp_path)], timeout=60)
        after = net.link_bytes()
        assert r.returncode == 0, r.stdout[-3000:]
        _check_layout(_probes(tmp_path), net.nodes)
        qdisc = subprocess.run(["ip", "netns", "exec", net.nodes[0], "tc", "qdisc", "show", "dev", "eth0"],
                               capture_output=True, text=True).stdout
        assert "tbf" in qdisc and "200Mbit" in qdisc, qdisc
    finally:
        net.shape(net.nodes[0], rate_mbit=0)
    # 4 MiB of float32 per rank: whatever the algorithm, each node must send the other at
    # least its half's partial sums (2 MiB); loopback or shared memory would leave ~0 here.
    for node in net.nodes:
        rx, tx = (a - b for a, b in zip(after[node], before[node]))
        assert rx > 2 << 20 and tx > 2 << 20, (node, rx, tx)


def test_slurm_across_nodes(net_slurm, tmp_path):
    """sbatch --nodes=2 --ntasks-per-node=2: srun --mpi=pmi2 places 2 ranks on each node."""
    batch = ("#!/bin/bash\n#SBATCH --time=2\n"
             f"srun --mpi=pmi2 --kill-on-bad-exit=1 {PY} -c \"$1\" \"$2\"\n")
    job_id, state, log, _ = submit_mpi_job(
        net_slurm, tmp_path, "probe", batch, args=[PROBE, str(tmp_path)], timeout=90,
        options=["--nodes=2", "--ntasks-per-node=2"],
        env={"UCX_NET_DEVICES": "eth0", "UCX_TLS": "tcp,sm,self"})
    assert state == "COMPLETED", _diag(net_slurm, job_id, log)
    _check_layout(_probes(tmp_path), net_slurm.net.nodes)


BUILD_AND_WAIT = """
import signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)  # as at a terminal, even if pytest was started with SIGINT ignored
sys.path.insert(0, {tests!r})
from netcluster import NetCluster
net = NetCluster(nodes=2).start()
import subprocess
p = subprocess.Popen(net.node_exec_argv(net.nodes[1], ["sleep", "600"]))
while not net.pids(net.nodes[1]):
    time.sleep(0.05)
print("READY", net.tag, " ".join(map(str, net.pids())), flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    """Running, not a zombie (this machine's init may never reap the orphans)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_cleanup_on_interrupt(net_nodes, sig, tmp_path):
    """A test process interrupted (Ctrl-C, or a CI timeout's SIGTERM) while its nodes run
    a process: the namespaces, links and that process are gone afterwards."""
    from netcluster import NetCluster

    code = BUILD_AND_WAIT.format(tests=str(Path(__file__).parents[1] / "support"))
    err = tmp_path / "stderr"
    with open(err, "w") as f:
        p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=f, text=True,
                             start_new_session=True)
    tag = None
    try:
        line = p.stdout.readline()
        assert line.startswith("READY"), line
        tag, *pids = line.split()[1:]
        os.kill(p.pid, sig)
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running 30 s after signal {sig}; its stderr:\n{err.read_text()[-3000:]}")
    finally:
        if p.poll() is None:  # the test failed: kill it and remove what its stop() did not
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            if tag:
                NetCluster.remove(tag)
    time.sleep(0.2)
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True).stdout
    assert f"zn{tag}-" not in netns and f"z{tag}" not in links.replace("zb", "z").replace("zv", "z"), \
        (netns, links)
    alive = [int(x) for x in pids if _alive(int(x))]
    assert not alive, f"left running: {alive}"
