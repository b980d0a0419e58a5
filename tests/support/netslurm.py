"""Slurm across the simulated nodes of tests/support/netcluster.py: one slurmctld in the root
namespace, one slurmd inside each node (NodeName = the node's hostname), sharing the
host's filesystem as a cluster shares its parallel file system.

    with NetCluster(nodes=2) as net, NetSlurm(net) as slurm:
        jid = slurm.sbatch("job.sh", options=["--nodes=2", "--ntasks-per-node=2"])
        slurm.wait(jid)

Everything else (munge, slurm.conf, job submission and polling, teardown by PID) is
tests/support/slurm_cluster.py's SlurmCluster. slurmctld gets a host name of its own (UTS
namespace) that the cluster's hosts file maps to the bridge address: it binds to what
its host name resolves to (FACTS.md). Job steps inherit their slurmd's namespaces, so
ranks on one node share /dev/shm and ranks on two nodes talk over the shaped link.
"""
from __future__ import annotations

import shlex

from slurm_cluster import SlurmCluster, _find


class NetSlurm(SlurmCluster):
    """A SlurmCluster whose nodes are `net`'s. slurmd_timeout: seconds a silent node
    stays up before slurmctld marks it down and requeues its jobs (node-loss tests)."""

    def __init__(self, net, slurmd_timeout: int = 10, **kw):
        # Declared, not real: the multi-node template asks 8 cores per task, 2 tasks per
        # node. Tests give the trainer its threads through the config (threads = 1).
        kw.setdefault("cpus", 16)
        super().__init__(**kw)
        self.net = net
        self.node = f"zc{net.tag}"  # slurmctld's host name (SlurmctldHost)
        self.ctld_addr = net.bridge_addr
        self.node_addrs = list(zip(net.nodes, net.addrs))
        self.slurmd_timeout = slurmd_timeout

    def _spawn(self, name: str, argv: list[str], **kw):
        if name == "slurmctld":
            hosts = shlex.quote(str(self.net.hosts_file))
            argv = [_find("unshare"), "--uts", "--mount", "--propagation", "private", "sh", "-c",
                    f"mount --bind {hosts} /etc/hosts && hostname {self.node} && exec "
                    + " ".join(map(shlex.quote, argv))]
        elif name.startswith("slurmd-"):
            argv = self.net.node_exec_argv(name[len("slurmd-"):], argv)
        return super()._spawn(name, argv, **kw)

    def node_states(self) -> dict[str, str]:
        return {n: self._node_state(n) for n in self.net.nodes}
