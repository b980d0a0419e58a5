"""The watchdog's side channel (zerompi/runtime/sidechannel.py) and its guarded abort
(runtime/abort.py), in one process: peers played by plain UDP sockets. Whole jobs:
tests/system/test_watchdog.py, tests/system/test_multinode_loss.py."""
import json
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from zerompi.runtime import sidechannel


@pytest.fixture
def me():
    """This test's own channel (a watchdog thread an earlier in-process test left serves
    only its own), as rank 0 of 3: rank 1 answers (also to a stray of another job, which
    it must not get), rank 2 is silent (a socket nobody reads: a stopped rank)."""
    ch = sidechannel.Channel()
    host, addrs, port, token = ch.open_socket()
    answering = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    answering.bind(("127.0.0.1", 0))
    silent = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    silent.bind(("127.0.0.1", 0))
    table = [(host, addrs, port, token), (host, [], answering.getsockname()[1], "x"),
             (host, [], silent.getsockname()[1], "y")]
    ch.set_peers(0, table)
    stop = threading.Event()
    seen = []

    def rank1():
        answering.settimeout(0.05)
        while not stop.is_set():
            try:
                data, addr = answering.recvfrom(4096)
            except socket.timeout:
                continue
            q = json.loads(data)
            seen.append(q)
            # a stray first (another job's token), then the answer
            answering.sendto(json.dumps({"t": "other", "to": 0, "r": 1, "n": q["n"], "s": ["x", 1, 1]}).encode(), addr)
            answering.sendto(json.dumps({"t": q["t"], "to": 0, "r": 1, "n": q["n"],
                                         "s": ["all_reduce", 4.5, 7]}).encode(), addr)

    t = threading.Thread(target=rank1, daemon=True)
    t.start()
    yield ch, seen
    stop.set()
    t.join()
    answering.close()
    silent.close()
    ch.close()


def test_survey_names_who_answered_and_ignores_strays(me):
    ch, seen = me
    answers = ch.survey(lambda: ("barrier", 1.0, 7), 0.8)
    assert answers == {1: ("all_reduce", 4.5, 7)}  # rank 2 silent; the stray ignored
    assert seen and all(q["to"] == 1 and q["q"] == 0 for q in seen)


def test_a_query_is_answered_with_this_ranks_status(me):
    ch, _ = me
    asker = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    asker.bind(("127.0.0.1", 0))
    asker.settimeout(2)
    port = ch.sock.getsockname()[1]
    for msg in ({"t": "wrong", "to": 0, "q": 2, "n": "a"}, {"t": ch.token, "to": 5, "q": 2, "n": "b"},
                {"t": ch.token, "to": 0, "q": 2, "n": "c"}):
        asker.sendto(json.dumps(msg).encode(), ("127.0.0.1", port))
    time.sleep(0.1)
    ch.serve(lambda: ("reduce_scatter", 2.0, 4))
    reply = json.loads(asker.recvfrom(4096)[0])  # only the well-addressed query is answered
    assert reply == {"t": ch.token, "to": 2, "r": 0, "n": "c", "s": ["reduce_scatter", 2.0, 4]}
    asker.close()


def test_survey_without_peers_asks_nobody():
    assert sidechannel.Channel().survey(lambda: (None, 0.0, None), 5.0) == {}


GUARDED = textwrap.dedent("""
    import os, signal, sys, threading, time
    from zerompi.runtime.abort import _guard_abort
    sys.modules["zerompi.runtime.abort"].ABORT_GRACE_S = 0.5
    import faulthandler; faulthandler.enable()
    def thread():
        _guard_abort(3)
        if sys.argv[1] == "crash":
            os.kill(os.getpid(), signal.SIGSEGV)  # as a crash inside MPI_Abort's exit()
        time.sleep(30)  # as an MPI_Abort that never returns
    threading.Thread(target=thread).start()
    time.sleep(30)
""")


@pytest.mark.parametrize("how,code", [("crash", 11), ("hang", 3)])
def test_guarded_abort_ends_quietly(how, code):
    """A crash in MPI_Abort's teardown ends the process without a crash report; an
    MPI_Abort that hangs is ended by the timer with the abort's status."""
    root = str(Path(__file__).resolve().parents[2])  # this checkout's zerompi
    r = subprocess.run([sys.executable, "-c", GUARDED, how], capture_output=True, text=True, timeout=20,
                       env={**os.environ, "PYTHONPATH": root})
    assert r.returncode == code, (r.returncode, r.stderr)
    assert "Fatal Python error" not in r.stderr and "Segmentation" not in r.stderr, r.stderr
