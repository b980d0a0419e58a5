"""K simulated nodes on one machine, for multi-node tests and benchmarks.

Each node is a network namespace `zn<tag>-<i>` (that is also its hostname) with one
veth link, `eth0` inside, plugged into a private bridge `zb<tag>` in the root namespace;
`tc tbf` on every node's eth0 shapes what leaves the node (bandwidth; `netem` adds
latency where the kernel has it). Processes are started inside a node by `node_exec`
with a private UTS (hostname), IPC and mount namespace and a fresh tmpfs on /dev/shm:
without those, MPI moves "inter-node" data through shared memory and nothing crosses the
shaped link. Ranks on one node share their /dev/shm, so the bandwidth hierarchy of a
real cluster (fast shared memory inside a node, a slower link between nodes) exists.
The filesystem is the host's, shared by every node as a cluster's parallel file system;
`private_dirs` puts a node-private tmpfs over given paths instead.

    with NetCluster(nodes=2, rate_mbit=400) as c:
        r = c.run_mpi(["python", "-c", "..."], ppn=2)        # mpiexec across the nodes
        c.link_bytes()                                        # per node: (rx, tx) of eth0

Slurm across the nodes: tests/support/netslurm.py. Cleanup (namespaces, links, every process
inside our namespaces, by PID) runs on success, failure, SIGTERM and Ctrl-C. Names carry
a per-process tag (pid), so two test runs on one machine do not collide, and no traffic
is ever sent to an address outside the namespaces created here.
"""
from __future__ import annotations

import atexit
import ipaddress
import itertools
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
_seq = itertools.count()


def available() -> tuple[bool, str]:
    """(True, "") when simulated nodes can be built here, else (False, why)."""
    if sys.platform != "linux":
        return False, "simulated nodes need Linux network namespaces"
    if os.geteuid() != 0:
        return False, "simulated nodes need root (network namespaces, veth, tc)"
    missing = [t for t in ("ip", "tc", "nsenter", "unshare", "mpiexec") if _which(t) is None]
    if missing:
        return False, f"missing {', '.join(missing)} (Debian: iproute2, util-linux; pip: mpich)"
    r = subprocess.run([_which("ip"), "netns", "list"], capture_output=True, text=True)
    if r.returncode != 0:
        return False, f"`ip netns` does not work here: {r.stderr.strip()}"
    return True, ""


def _which(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin:/usr/local/sbin")


def _sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run([_which(argv[0]) or argv[0], *argv[1:]], capture_output=True, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} -> rc={r.returncode}: {r.stderr.strip()}")
    return r


def _used_networks() -> list:
    out = _sh("ip", "-4", "-o", "addr", "show").stdout + _sh("ip", "-4", "route", "show").stdout
    nets = []
    for tok in out.split():
        if "/" in tok and tok[0].isdigit():
            try:
                nets.append(ipaddress.ip_network(tok, strict=False))
            except ValueError:
                pass
    return nets


def _free_subnet(seed: int) -> ipaddress.IPv4Network:
    """A /24 in 10.0.0.0/8 that no address or route of this machine overlaps."""
    used = _used_networks()
    for k in range(256 * 200):
        i = (seed + k * 7919) % (256 * 200)
        net = ipaddress.ip_network(f"10.{50 + i // 256}.{i % 256}.0/24")
        if not any(net.overlaps(u) for u in used):
            return net
    raise RuntimeError("no free 10.x.y.0/24 subnet for the simulated nodes")


class NetCluster:
    """K nodes (2..4) on a private bridge, shaped to `rate_mbit` (None: unshaped) with
    `latency_ms` one way (needs sch_netem). Attributes after start(): nodes (names =
    hostnames = namespaces), addrs, bridge, bridge_addr, workdir, hostfile."""

    def __init__(self, nodes: int = 2, rate_mbit: float | None = 1000, latency_ms: float = 0.0,
                 private_dirs=(), workdir=None, keep: bool = False):
        if not 1 <= nodes <= 4:
            raise ValueError(f"nodes = {nodes}: 1 to 4 simulated nodes")
        self.k, self.rate_mbit, self.latency_ms = nodes, rate_mbit, latency_ms
        self.private_dirs = [str(Path(d).resolve()) for d in private_dirs]
        self.tag = f"{os.getpid():x}{next(_seq):x}"
        self.nodes = [f"zn{self.tag}-{i + 1}" for i in range(nodes)]
        self.bridge = f"zb{self.tag}"
        self._veths = [f"zv{self.tag}{i + 1}" for i in range(nodes)]  # host side; eth0 inside
        self._own_workdir, self.keep = workdir is None, keep
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix=f"znet-{self.tag}-", dir="/tmp"))
        self._made: list[tuple[str, str]] = []  # what exists, for teardown: ("netns"|"link", name)
        self._old_sigterm = None
        self._ns_inodes: set[int] = set()

    # ---------------------------------------------------------------- set-up
    def start(self) -> "NetCluster":
        ok, why = available()
        if not ok:
            raise RuntimeError(why)
        atexit.register(self.stop)
        self._hook_sigterm()
        try:
            self._build()
        except BaseException:
            self.stop()
            raise
        return self

    def _build(self) -> None:
        net = _free_subnet(os.getpid() * 16 + int(self.tag[-1], 16))
        hosts = list(net.hosts())
        self.bridge_addr, self.addrs = str(hosts[-1]), [str(hosts[i]) for i in range(self.k)]
        self.prefix = net.prefixlen
        _sh("ip", "link", "add", self.bridge, "type", "bridge")
        self._made.append(("link", self.bridge))
        _sh("ip", "addr", "add", f"{self.bridge_addr}/{self.prefix}", "dev", self.bridge)
        _sh("ip", "link", "set", self.bridge, "up")
        for node, veth, addr in zip(self.nodes, self._veths, self.addrs):
            _sh("ip", "netns", "add", node)
            self._made.append(("netns", node))
            self._ns_inodes.add(os.stat(f"/run/netns/{node}").st_ino)
            _sh("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", node)
            self._made.append(("link", veth))
            _sh("ip", "link", "set", veth, "master", self.bridge, "up")
            ns = ("ip", "-n", node)
            _sh(*ns, "addr", "add", f"{addr}/{self.prefix}", "dev", "eth0")
            _sh(*ns, "link", "set", "eth0", "up")
            _sh(*ns, "link", "set", "lo", "up")
            self.shape(node)
        self.hosts_file = self.workdir / "hosts"
        self.hosts_file.write_text("127.0.0.1 localhost\n" + "".join(
            f"{a} {n}\n" for a, n in zip([self.bridge_addr, *self.addrs], [f"zc{self.tag}", *self.nodes])))
        self.launcher = self.workdir / "node-launcher"
        # hydra's ssh launcher calls `LAUNCHER [ssh options] HOST COMMAND...`.
        self.launcher.write_text("#!/bin/sh\nwhile [ \"${1#-}\" != \"$1\" ]; do shift; done\n"
                                 f"host=$1; shift\nexec {shlex.quote(sys.executable)} "
                                 f"{shlex.quote(str(HERE / 'netcluster.py'))} exec "
                                 f"{shlex.quote(str(self.workdir))} \"$host\" \"$*\"\n")
        self.launcher.chmod(0o755)
        self.set_private_dirs(self.private_dirs)

    def set_private_dirs(self, dirs, nodes=None) -> None:
        """Paths that processes started from now on in `nodes` (default: all; not slurmd's
        steps) see as a node-private tmpfs: a run directory the nodes do not share."""
        self.private_dirs = [str(Path(d).resolve()) for d in dirs]
        for node in self.nodes:
            mine = self.private_dirs if nodes is None or node in nodes else []
            (self.workdir / f"private_dirs-{node}").write_text("".join(d + "\n" for d in mine))

    def shape(self, node: str, rate_mbit: float | None = None, latency_ms: float | None = None) -> None:
        """(Re)shape what leaves `node`: a token bucket at rate_mbit, plus netem delay."""
        rate = self.rate_mbit if rate_mbit is None else rate_mbit
        lat = self.latency_ms if latency_ms is None else latency_ms
        ns = ("ip", "netns", "exec", node, "tc", "qdisc")
        _sh(*ns, "del", "dev", "eth0", "root", check=False)
        parent = ("root",)
        if lat:
            r = _sh(*ns, "add", "dev", "eth0", "root", "handle", "1:", "netem", "delay", f"{lat}ms", check=False)
            if r.returncode:
                raise RuntimeError(f"latency_ms = {lat}: netem is not available in this kernel "
                                   f"({r.stderr.strip()})")
            parent = ("parent", "1:")
        if rate:
            # burst: at least one 64 KiB GSO segment plus 1 ms at the rate, or tbf drops it.
            burst = max(128 * 1024, int(rate * 1e6 / 8 / 1000))
            _sh(*ns, "add", "dev", "eth0", *parent, "handle", "2:", "tbf", "rate", f"{rate}mbit",
                "burst", str(burst), "latency", "200ms")

    # ----------------------------------------------------------- running things
    def node_exec_argv(self, node: str, argv: list[str]) -> list[str]:
        """argv that runs `argv` inside `node` (see `_enter`), as the same process: its
        PID is the one a Popen of this argv reports."""
        return [sys.executable, str(HERE / "netcluster.py"), "exec", str(self.workdir), node,
                "exec " + " ".join(shlex.quote(a) for a in argv)]

    def mpiexec_argv(self, n: int | None = None, ppn: int = 2, nodes: list[str] | None = None) -> list[str]:
        """`mpiexec` across `nodes` (default all) with `ppn` ranks each, over TCP on eth0."""
        nodes = nodes or self.nodes
        n = n or ppn * len(nodes)
        return [_which("mpiexec"), "-launcher", "ssh", "-launcher-exec", str(self.launcher),
                "-iface", self.bridge, "-hosts", ",".join(f"{h}:{ppn}" for h in nodes), "-n", str(n),
                *(x for k, v in self.mpi_env().items() for x in ("-genv", k, v))]

    @staticmethod
    def mpi_env() -> dict[str, str]:
        # TCP between nodes on eth0, shared memory inside a node (UCX's names).
        return {"UCX_NET_DEVICES": "eth0", "UCX_TLS": "tcp,sm,self", "OMP_NUM_THREADS": "1"}

    def link_bytes(self) -> dict[str, tuple[int, int]]:
        """{node: (rx, tx)} of its eth0, read on the host side of the veth (swapped)."""
        out = {}
        for node, veth in zip(self.nodes, self._veths):
            st = Path(f"/sys/class/net/{veth}/statistics")
            out[node] = (int((st / "tx_bytes").read_text()), int((st / "rx_bytes").read_text()))
        return out

    def link_down(self, node: str) -> None:
        """Cut `node` off the bridge (both directions), as a failed cable or switch port."""
        _sh("ip", "link", "set", self._veths[self.nodes.index(node)], "down")

    def pids(self, node: str | None = None) -> list[int]:
        """Processes inside our namespaces (or one node's), by /proc/PID/ns/net inode."""
        want = self._ns_inodes if node is None else {os.stat(f"/run/netns/{node}").st_ino}
        out = []
        for d in os.listdir("/proc"):
            if d.isdigit() and int(d) != os.getpid():
                try:
                    if os.stat(f"/proc/{d}/ns/net").st_ino in want:
                        out.append(int(d))
                except OSError:
                    pass
        return out

    def kill_node(self, node: str, sig: int = signal.SIGKILL) -> list[int]:
        """Send `sig` to every process of `node` (as if it lost power); returns the PIDs."""
        pids = self.pids(node)
        for p in pids:
            try:
                os.kill(p, sig)
            except ProcessLookupError:
                pass
        return pids

    # ---------------------------------------------------------------- teardown
    def _hook_sigterm(self) -> None:
        # A CI timeout SIGTERMs pytest: turn it into KeyboardInterrupt so stop() runs.
        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            def _on_term(signum, frame):
                raise KeyboardInterrupt(f"signal {signum}")
            self._old_sigterm = signal.signal(signal.SIGTERM, _on_term)

    def stop(self) -> None:
        """Kill every process inside our namespaces, delete links and namespaces."""
        if self._old_sigterm is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._old_sigterm)
            self._old_sigterm = None
        for _ in range(20):
            pids = self.pids() if self._ns_inodes else []
            if not pids:
                break
            for p in pids:
                try:
                    os.kill(p, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)
        for kind, name in reversed(self._made):
            if kind == "link":
                _sh("ip", "link", "del", name, check=False)
            else:
                _sh("ip", "netns", "del", name, check=False)
        self._made.clear()
        atexit.unregister(self.stop)
        if self._own_workdir and not self.keep:
            shutil.rmtree(self.workdir, ignore_errors=True)

    @staticmethod
    def remove(tag: str) -> None:
        """Delete the namespaces, bridge and own workdir of the cluster tagged `tag` (one whose
        process was killed before its stop() ran; the veths go with the namespaces); its
        processes must be gone already."""
        for line in _sh("ip", "netns", "list", check=False).stdout.splitlines():
            if line.startswith(f"zn{tag}-"):
                _sh("ip", "netns", "del", line.split()[0], check=False)
        _sh("ip", "link", "del", f"zb{tag}", check=False)
        for d in Path(tempfile.gettempdir()).glob(f"znet-{tag}-*"):  # its own workdir
            shutil.rmtree(d, ignore_errors=True)

    def __enter__(self) -> "NetCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _enter(workdir: str, node: str, command: str) -> None:
    """Become a process of `node` and run `command` there with sh: its network namespace,
    then private UTS/IPC/mount namespaces with its hostname, a fresh /dev/shm, the
    cluster's /etc/hosts and node-private tmpfs over the private_dirs. (nsenter, not
    `ip netns exec`: that remounts /sys, and slurmd then misses /sys/fs/cgroup.)"""
    w = Path(workdir)
    private = [d for d in (w / f"private_dirs-{node}").read_text().split("\n") if d]
    setup = ["mount -t tmpfs tmpfs /dev/shm", f"mount --bind {shlex.quote(str(w / 'hosts'))} /etc/hosts",
             f"hostname {shlex.quote(node)}"]
    setup += [f"mkdir -p {shlex.quote(d)} && mount -t tmpfs tmpfs {shlex.quote(d)}" for d in private]
    os.execv(_which("nsenter"), ["nsenter", f"--net=/run/netns/{node}", _which("unshare"), "--uts", "--ipc",
                                 "--mount", "--propagation", "private", "sh", "-c",
                                 " && ".join(setup) + ' && eval "$1"', "node-exec", command])


if __name__ == "__main__":
    # `python tests/support/netcluster.py exec WORKDIR NODE COMMAND`: the node launcher (see _enter).
    if len(sys.argv) == 5 and sys.argv[1] == "exec":
        _enter(*sys.argv[2:])
    sys.exit("usage: netcluster.py exec WORKDIR NODE COMMAND")
