"""The watchdog's side channel: "where are you?" between ranks over UDP, not MPI.

When a deadline expires, the main thread is blocked inside MPI (an all-gather whose
peer is on a lost node). Asking the other ranks through MPI from the watchdog thread at
that moment crashed the process: MPICH's send to a rank whose connection the transport
had declared dead segfaulted inside the library (`PMPI_Isend_c`) while the main thread
sat in `PMPI_Allgatherv_c`. Here each rank's watchdog thread owns one UDP socket,
opened before the first collective of the job; the table of every rank's addresses is
exchanged once, in the collective that maps ranks to nodes (parallel.nodes.discover).
Why UDP (docs/reliability.md, "The watchdog's side channel"): no connection to set up
or to break, a datagram to a dead or unreachable host is simply lost, nothing blocks,
and nothing shares state with MPI; the worst a failure here can do is a rank reported
as silent. Every datagram carries the job's token (random, from rank 0) and the rank it
is meant for, so strays from other jobs on the host, or a port number reused by
another rank, are ignored. Payloads are JSON, never pickles.
"""
from __future__ import annotations

import fcntl
import json
import os
import select
import socket
import struct
import time

_SIOCGIFADDR = 0x8915
_RESEND_S = 0.5      # a query is sent again to a silent rank this often (a datagram may be lost)
_MAX_ADDRS = 8       # addresses advertised per rank (one per interface)


def _local_addrs() -> list[str]:
    """This host's IPv4 addresses, loopback excluded: one per interface (Linux ioctl)."""
    out = []
    try:
        names = [n for _, n in socket.if_nameindex()]
    except OSError:
        names = []
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for name in names:
            try:
                raw = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            addr = socket.inet_ntoa(raw[20:24])
            if not addr.startswith("127.") and addr not in out:
                out.append(addr)
    finally:
        probe.close()
    return out[:_MAX_ADDRS]


class Channel:
    """One rank's socket and the table of where to ask the others. One reader per
    socket: the watchdog thread owns the job's channel (watchdog.S.side) and is the only
    thread that serves or surveys it."""

    def __init__(self):
        self.sock: socket.socket | None = None
        self.token = ""
        self.rank = -1
        self.peers: dict[int, list[tuple[str, int]]] = {}   # rank -> where to ask it

    def open_socket(self) -> tuple:
        """Open this rank's socket (once); returns what the others need to reach it:
        (host name, addresses, port, a random token)."""
        if self.sock is None:
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            s.bind(("0.0.0.0", 0))
            s.setblocking(False)
            self.sock = s
        return (socket.gethostname(), _local_addrs(), self.sock.getsockname()[1], os.urandom(8).hex())

    def set_peers(self, rank: int, table: list) -> None:
        """`table[q]` = rank q's open_socket(); the job's token is rank 0's. Ranks on this
        host are asked on loopback too (same host name: one network namespace)."""
        if self.sock is None:
            return
        me = table[rank][0]
        peers = {}
        for q, (host, addrs, port, _) in enumerate(table):
            if q != rank:
                where = (["127.0.0.1"] if host == me else []) + list(addrs)
                peers[q] = [(a, int(port)) for a in where]
        self.token, self.rank, self.peers = table[0][3], rank, peers

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
        self.sock, self.token, self.rank, self.peers = None, "", -1, {}

    def ready(self) -> bool:
        return self.sock is not None and bool(self.peers)

    def fileno(self) -> int | None:
        return self.sock.fileno() if self.sock is not None else None

    def _send(self, msg: dict, where) -> None:
        data = json.dumps(msg).encode()
        for addr in where:
            try:
                self.sock.sendto(data, addr)
            except OSError:  # unreachable, no route, buffer full: as if lost
                pass

    def _receive(self):
        """The next well-formed datagram of this job, with its sender: (msg, addr) or None."""
        while True:
            try:
                data, addr = self.sock.recvfrom(4096)
            except (BlockingIOError, InterruptedError):
                return None
            except OSError:
                return None
            try:
                msg = json.loads(data)
            except ValueError:
                continue
            if isinstance(msg, dict) and msg.get("t") == self.token and msg.get("to") == self.rank:
                return msg, addr

    def serve(self, status) -> dict:
        """Answer every pending query with `status()`; returns the replies read meanwhile
        ({rank: (nonce, status)}), for a survey in progress."""
        replies = {}
        if self.sock is None or not self.token:
            return replies
        while True:
            got = self._receive()
            if got is None:
                return replies
            msg, addr = got
            if "q" in msg:
                self._send({"t": self.token, "to": msg["q"], "r": self.rank, "n": msg.get("n"),
                            "s": list(status())}, [addr])
            elif "r" in msg and isinstance(msg.get("s"), list) and len(msg["s"]) == 3:
                replies[msg["r"]] = (msg.get("n"), tuple(msg["s"]))

    def survey(self, status, seconds: float) -> dict[int, tuple]:
        """Ask every other rank for its status, for at most `seconds`; {rank: status} of
        those that answered (the others are silent: stopped, dead, unreachable)."""
        if not self.ready():
            return {}
        nonce = os.urandom(4).hex()
        answers: dict[int, tuple] = {}
        t_end = time.monotonic() + seconds
        next_send = 0.0
        while len(answers) < len(self.peers):
            now = time.monotonic()
            if now >= t_end:
                break
            if now >= next_send:
                for q, where in self.peers.items():
                    if q not in answers:
                        self._send({"t": self.token, "to": q, "q": self.rank, "n": nonce}, where)
                next_send = now + _RESEND_S
            try:
                select.select([self.sock], [], [], max(0.0, min(next_send, t_end) - time.monotonic()))
            except (OSError, ValueError):
                time.sleep(0.01)
            for q, (n, st) in self.serve(status).items():
                if n == nonce and q in self.peers:
                    answers[q] = st
        return answers
