"""A throwaway single-node Slurm cluster on loopback, for tests.

Everything (munge key/socket, slurm.conf, state, spool, logs, pid files)
lives under one work directory; nothing in /etc is read except what the
Debian packages installed (plugins).  Daemons run in the foreground as our
children so we know their PIDs and can always stop them.

    with SlurmCluster() as c:          # state in a fresh /tmp/zslurm-* dir
        jid = c.sbatch("job.sh", "arg1", options=["--ntasks=2"])
        assert c.wait(jid, timeout=60) == "COMPLETED"

An explicit workdir must be reachable by user munge (pytest's tmp_path is not:
its parents are 0700).

Install the packages with .ci/install_debian.sh (see tests/run.sh).
"""

from __future__ import annotations

import atexit
import ctypes
import os
import pwd
import re
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from slurm_conf import cluster_env, munge_dir, node_names, real_memory_mb, slurm_conf

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "scontrol", "sinfo", "squeue", "scancel")

# Job states after which a job will not run again (REQUEUED/PENDING are not).
TERMINAL_STATES = frozenset({
    "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED",
    "BOOT_FAIL", "DEADLINE", "OUT_OF_MEMORY", "REVOKED", "SPECIAL_EXIT",
})


def _find(name: str) -> str | None:
    # The daemons live in /usr/sbin, which a non-login PATH may lack.
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin:/usr/local/sbin")


def slurm_available() -> tuple[bool, str]:
    """(True, "") when a private cluster can be started here, else (False, why)."""
    missing = [n for n in DAEMONS + CLIENTS if _find(n) is None]
    if missing:
        return False, ("Slurm/munge not installed (missing %s); run .ci/install_debian.sh slurmctld slurmd slurm-client munge"
                       % ", ".join(missing))
    if os.geteuid() != 0:
        # slurmd must be root to start job steps (setuid, privileged spool).
        return False, "a private Slurm cluster needs root (slurmd runs job steps as root here)"
    if not hasattr(os, "fork") or not Path("/proc/self/environ").exists():
        return False, "needs Linux /proc"
    return True, ""


_libc = ctypes.CDLL(None, use_errno=True)


def _die_with_parent() -> None:
    # Runs in the daemon child before exec: if the test process is killed
    # outright (SIGKILL, CI timeout), the kernel sends the daemon SIGTERM.
    _libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _short_hostname() -> str:
    # slurmctld insists that SlurmctldHost names the machine it runs on.
    return socket.gethostname().split(".")[0]


def parse_kv(text: str) -> dict[str, str]:
    """Parse `scontrol -o show ...` output (Key=Value pairs, values may hold spaces)."""
    out: dict[str, str] = {}
    for m in re.finditer(r"(?:^|\s)([A-Za-z][\w:/.\-]*)=(.*?)(?=\s+[A-Za-z][\w:/.\-]*=|\s*$)", text.strip()):
        out.setdefault(m.group(1), m.group(2))
    return out


class SlurmError(RuntimeError):
    pass


class SlurmCluster:
    """Single-node Slurm cluster bound to 127.0.0.1.

    Attributes after start(): ``env`` (environment for Slurm commands and jobs,
    with SLURM_CONF), ``conf`` (slurm.conf path), ``node`` (node name),
    ``workdir``, ``logdir``.
    """

    def __init__(self, workdir: str | os.PathLike | None = None, *, cpus: int | None = None,
                 cred_expire: int = 10, startup_timeout: float = 60.0, keep: bool | None = None):
        # A workdir we create is removed on stop() unless keep (or
        # ZEROMPI_KEEP_SLURM_DIR=1) asks to keep its logs.
        self._own_workdir = workdir is None
        if keep is None:
            keep = os.environ.get("ZEROMPI_KEEP_SLURM_DIR", "") not in ("", "0")
        self.keep = keep
        if workdir is None:
            # Short and traversable by user munge (pytest's tmp dirs are 0700),
            # and the munge socket path must fit in sun_path (108 bytes).
            workdir = tempfile.mkdtemp(prefix="zslurm-", dir="/tmp")
        self.workdir = Path(workdir).resolve()
        # The 2-rank tests need >= 2 CPUs; config_overrides lets us declare
        # them even on a 1-core CI box.
        self.cpus = cpus or max(2, os.cpu_count() or 1)
        self.cred_expire = cred_expire
        self.startup_timeout = startup_timeout
        self.node = _short_hostname()
        self.ctld_addr, self.node_addrs, self.slurmd_timeout = "127.0.0.1", None, 300  # netslurm.py: others
        # Unique tag put in every daemon's and job's environment, so teardown
        # can find stray slurmstepd/task processes of *this* cluster by PID.
        self.tag = secrets.token_hex(8)
        self._procs: dict[str, subprocess.Popen] = {}
        self._old_sigterm = None
        self._logs: list = []
        self.env: dict[str, str] = {}
        self.conf = self.workdir / "etc" / "slurm.conf"
        self.logdir = self.workdir / "log"

    # ---------------------------------------------------------------- setup
    def _write_files(self) -> None:
        w = self.workdir
        w.mkdir(parents=True, exist_ok=True)
        os.chmod(w, 0o755)  # munged (user munge) must traverse it
        for d in ("etc", "state", "spool", "log", "run"):
            (w / d).mkdir(exist_ok=True)
        self.munge_socket = munge_dir(w)

        self.first_job_id = secrets.randbelow(60_000_000) + 1_000_000
        self.ctld_port = _free_port()
        self.slurmd_port = _free_port()
        while self.slurmd_port == self.ctld_port:
            self.slurmd_port = _free_port()

        conf = slurm_conf(w=w, node=self.node, cpus=self.cpus, real_memory_mb=real_memory_mb(),
                          ctld_port=self.ctld_port, slurmd_port=self.slurmd_port, munge_socket=self.munge_socket,
                          cred_expire=self.cred_expire, first_job_id=self.first_job_id, ctld_addr=self.ctld_addr,
                          nodes=self.node_addrs, slurmd_timeout=self.slurmd_timeout)
        self.conf.write_text(conf)
        for node in node_names(self.node, self.node_addrs):
            (w / "spool" / node).mkdir(exist_ok=True)

        self.env = cluster_env(self.conf, self.tag)

    def _spawn(self, name: str, argv: list[str], **kw) -> subprocess.Popen:
        log = open(self.logdir / f"{name}.stdout", "ab")
        self._logs.append(log)
        p = subprocess.Popen(argv, env=self.env, stdin=subprocess.DEVNULL, stdout=log,
                             stderr=subprocess.STDOUT, start_new_session=True,
                             preexec_fn=_die_with_parent, **kw)
        self._procs[name] = p
        return p

    def _wait_until(self, what: str, pred, timeout: float, interval: float = 0.3):
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            for name, p in self._procs.items():
                if p.poll() is not None:
                    raise SlurmError(f"{name} exited with {p.returncode} while waiting for "
                                     f"{what}\n{self.log_tail()}")
            try:
                last = pred()
                if last:
                    return last
            except (subprocess.SubprocessError, OSError) as e:
                last = e
            time.sleep(interval)
        raise SlurmError(f"timed out after {timeout:.0f}s waiting for {what} "
                         f"(last: {last!r})\n{self.log_tail()}")

    def start(self) -> "SlurmCluster":
        ok, why = slurm_available()
        if not ok:
            raise SlurmError(why)
        self._write_files()
        atexit.register(self.stop)  # safety net if the caller never reaches stop()
        self._hook_sigterm()
        m = self.workdir / "munge"
        munged = [_find("munged"), "-F", f"--key-file={m}/munge.key", f"--socket={self.munge_socket}",
                  f"--pid-file={m}/munged.pid", f"--log-file={m}/munged.log",
                  f"--seed-file={m}/munged.seed", "--num-threads=2"]
        try:
            pwd.getpwnam("munge")
            kw = {"user": "munge", "group": "munge", "extra_groups": []}
        except KeyError:
            munged.append("--force")
            kw = {}
        try:
            self._spawn("munged", munged, **kw)
            self._wait_until("munge socket", self.munge_socket.exists, 15)
            self._spawn("slurmctld", [_find("slurmctld"), "-D", "-c", "-i", "-f", str(self.conf)])
            self._wait_until("slurmctld", lambda: "UP" in self.scontrol("ping", check=False).stdout,
                             self.startup_timeout)
            nodes = node_names(self.node, self.node_addrs)  # one slurmd each (tests/support/netslurm.py: several)
            for node in nodes:
                self._spawn(f"slurmd-{node}", [_find("slurmd"), "-D", "-f", str(self.conf), "-N", node])
            self._wait_until("nodes idle", lambda: all(self._node_state(n) == "idle" for n in nodes),
                             self.startup_timeout)
        except BaseException:
            self.stop()
            raise
        return self

    # -------------------------------------------------------------- helpers
    def run(self, argv: list[str], *, timeout: float = 30, check: bool = True,
            cwd=None, env: dict | None = None) -> subprocess.CompletedProcess:
        """Run a Slurm client command against this cluster."""
        e = dict(self.env)
        if env:
            e.update(env)
        r = subprocess.run(argv, env=e, cwd=cwd, capture_output=True, text=True,
                           timeout=timeout, stdin=subprocess.DEVNULL)
        if check and r.returncode != 0:
            raise SlurmError(f"{' '.join(map(str, argv))} -> rc={r.returncode}\n"
                             f"stdout: {r.stdout}\nstderr: {r.stderr}")
        return r

    def scontrol(self, *args: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
        return self.run(["scontrol", *args], check=check, timeout=timeout)

    def _node_state(self, node: str | None = None) -> str:
        r = self.run(["sinfo", "-h", "-N", "-n", node or self.node, "-o", "%T"], check=False, timeout=10)
        return r.stdout.strip().rstrip("*~#$@+")

    def sbatch(self, script: str | os.PathLike, *args: str, options=(), cwd=None,
               env: dict | None = None, timeout: float = 30) -> int:
        """Submit `script args...` with extra sbatch `options`; returns the job id.

        The job inherits ``self.env`` (+ ``env``); cwd defaults to the script's dir.
        """
        script = Path(script).resolve()
        r = self.run(["sbatch", "--parsable", *options, str(script), *args],
                     cwd=cwd or script.parent, env=env, timeout=timeout)
        return int(r.stdout.strip().split(";")[0])

    def job_info(self, job_id: int) -> dict[str, str]:
        """`scontrol show job` as a dict ({} if the job is unknown)."""
        r = self.scontrol("-o", "show", "job", str(job_id), check=False, timeout=15)
        if r.returncode != 0:
            return {}
        return parse_kv(r.stdout.splitlines()[0]) if r.stdout.strip() else {}

    def state(self, job_id: int) -> str:
        return self.job_info(job_id).get("JobState", "UNKNOWN")

    def wait(self, job_id: int, timeout: float = 120, interval: float = 0.5) -> str:
        """Poll until the job reaches a terminal state; return it (e.g. "COMPLETED").

        REQUEUED/PENDING are not terminal, so a requeued job is followed to
        its final run.  Raises TimeoutError with the job record on timeout.
        """
        deadline = time.monotonic() + timeout
        info: dict[str, str] = {}
        while time.monotonic() < deadline:
            info = self.job_info(job_id)
            st = info.get("JobState", "")
            if st in TERMINAL_STATES:
                return st
            time.sleep(interval)
        raise TimeoutError(f"job {job_id} not finished after {timeout}s: {info}")

    def cancel_all(self, timeout: float = 20) -> None:
        """Cancel every job of this (private) cluster and wait for them to drain."""
        r = self.run(["squeue", "-h", "-o", "%i"], check=False, timeout=10)
        ids = r.stdout.split()
        if not ids:
            return
        self.run(["scancel", *ids], check=False, timeout=10)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            r = self.run(["squeue", "-h", "-o", "%i"], check=False, timeout=10)
            if r.returncode != 0 or not r.stdout.strip():
                return
            time.sleep(0.5)

    def log_tail(self, n: int = 30) -> str:
        out = []
        for f in sorted(self.logdir.glob("*")) + [self.workdir / "munge" / "munged.log"]:
            try:
                lines = f.read_text(errors="replace").splitlines()[-n:]
            except OSError:
                continue
            out.append(f"==> {f.name} <==\n" + "\n".join(lines))
        return "\n".join(out)

    # ------------------------------------------------------------- teardown
    def _hook_sigterm(self) -> None:
        # A CI timeout SIGTERMs the test process; by default Python then dies without
        # teardown and slurmstepd + job processes outlive it. Turn it into
        # KeyboardInterrupt so pytest (or a `with` block) unwinds and stop() runs.
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            def _on_term(signum, frame):
                raise KeyboardInterrupt(f"signal {signum}")
            self._old_sigterm = signal.signal(signal.SIGTERM, _on_term)

    def _unhook_sigterm(self) -> None:
        if self._old_sigterm is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._old_sigterm)
            self._old_sigterm = None

    def _tagged_pids(self) -> list[int]:
        """PIDs (not ours) whose environment carries this cluster's tag:
        slurmstepd and job processes that outlived slurmd."""
        needle = f"ZEROMPI_SLURM_TEST_TAG={self.tag}".encode()
        pids = []
        for d in Path("/proc").iterdir():
            if not d.name.isdigit() or int(d.name) == os.getpid():
                continue
            try:
                if needle in (d / "environ").read_bytes().split(b"\0"):
                    pids.append(int(d.name))
            except OSError:
                pass
        return pids

    @staticmethod
    def _terminate(p: subprocess.Popen, grace: float) -> None:
        if p.poll() is not None:
            return
        try:
            p.send_signal(signal.SIGTERM)
            p.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            p.kill()
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        except ProcessLookupError:
            pass

    def stop(self) -> None:
        """Cancel jobs, stop slurmd, slurmctld, munged (SIGTERM then SIGKILL), kill strays."""
        self._unhook_sigterm()
        try:
            if "slurmctld" in self._procs and self._procs["slurmctld"].poll() is None:
                self.cancel_all()
        except Exception:
            pass  # teardown must go on
        for name in [n for n in self._procs if n.startswith("slurmd")] + ["slurmctld", "munged"]:
            p = self._procs.get(name)
            if p is not None:
                self._terminate(p, grace=10)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            pids = self._tagged_pids()
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except OSError:
                    pass
            if pids and sig == signal.SIGTERM:
                time.sleep(1)
        for f in self._logs:
            f.close()
        self._logs.clear()
        self._procs.clear()
        atexit.unregister(self.stop)
        if self._own_workdir and not self.keep:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> "SlurmCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


if __name__ == "__main__":
    # A one-node cluster to try slurm/*.sbatch by hand (docs/quickstart.md):
    #   sudo python tests/support/slurm_cluster.py      # prints the export line, runs until Ctrl-C
    import sys

    with SlurmCluster(keep=True) as c:
        print(f"Slurm is up on {c.node} (state and logs in {c.workdir}). In another shell:\n"
              f"  export SLURM_CONF={c.conf}\n  sinfo; sbatch slurm/cpu.sbatch; squeue\n"
              "Ctrl-C stops every daemon and job of this cluster.", flush=True)
        try:
            signal.pause()
        except KeyboardInterrupt:
            print("stopping", file=sys.stderr)
