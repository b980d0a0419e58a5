"""Where the suite's CPU goes, per test: `bash tests/run.sh --cpu-profile` (conftest.py
registers this module as a plugin).

The suite is bound by CPU (tests/README.md), and a test's wall time says little about its
cost: a Slurm test waits 30 s at no cost, a 4-rank job's 5 s take 15 CPU-seconds from the
other worker. This plugin records each test's CPU time, its own plus that of every
process it started and reaped (mpiexec reaps its proxies, they reap the ranks), and at
the end prints the files and tests that cost the most. Not counted: jobs that Slurm's
daemons start, and ranks their launcher does not wait for (an aborted or killed job):
the failure, watchdog and kill tests cost more than they show. So the machine's own count
(/proc/stat) is kept beside it: the busy and idle core-seconds of the whole run, and of
each test's interval (shared with the test the other worker ran meanwhile), and so is the
VM's speed (`import torch`'s CPU time, measured before the run), to compare runs on
different days by (docs/performance.md, "The test suite", has what they showed).
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

TOP = 15


def _log_dir(config) -> Path:
    return Path(str(config.rootpath)) / ".pytest_cache" / "cpu_profile"


def _worker(config) -> str | None:
    return getattr(config, "workerinput", {}).get("workerid")


def machine() -> tuple[float, float]:
    """(busy, idle) core-seconds this machine has spent since boot (/proc/stat: idle and
    iowait count as idle); (0, 0) where there is no /proc/stat."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return 0.0, 0.0
    hz, idle = os.sysconf("SC_CLK_TCK"), ticks[3] + ticks[4]
    return (sum(ticks) - idle) / hz, idle / hz


def torch_import_cpu(runs: int = 3) -> float:
    """Median CPU seconds of `python -c "import torch"`: the VM's speed. VMs of one kind
    differ in it from day to day, and a run's total moves with it more than with most
    changes (docs/performance.md, "The test suite")."""
    got = []
    for _ in range(runs):
        t0 = os.times()
        subprocess.run([sys.executable, "-c", "import torch"], check=True)
        t1 = os.times()
        got.append(t1.children_user + t1.children_system - t0.children_user - t0.children_system)
    return statistics.median(got)


_session: dict = {}


def start(config):
    if _worker(config) is None:  # the controller (or the only process): a fresh record
        d = _log_dir(config)
        d.mkdir(parents=True, exist_ok=True)
        for f in d.glob("*.jsonl"):
            f.unlink()
        _session.update(torch_cpu=torch_import_cpu(), machine=machine(), wall=time.monotonic())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    t0, w0, m0 = os.times(), time.monotonic(), machine()
    yield
    t1, m1 = os.times(), machine()
    cpu = sum(getattr(t1, k) - getattr(t0, k) for k in ("user", "system", "children_user", "children_system"))
    path = _log_dir(item.config) / f"{_worker(item.config) or 'main'}.jsonl"
    with open(path, "a") as f:
        f.write(json.dumps({"id": item.nodeid, "cpu": cpu, "wall": time.monotonic() - w0,
                            "machine_idle": m1[1] - m0[1]}) + "\n")


def pytest_terminal_summary(terminalreporter, config):
    if _worker(config) is not None:
        return
    rows = [json.loads(line) for f in sorted(_log_dir(config).glob("*.jsonl")) for line in f.open()]
    if not rows:
        return
    cpu, wall, count = Counter(), Counter(), Counter()
    for r in rows:
        path = r["id"].split("::")[0]
        cpu[path] += r["cpu"]
        wall[path] += r["wall"]
        count[path] += 1
    tr = terminalreporter
    if _session.get("machine", (0, 0))[0]:
        busy, idle = (b - a for a, b in zip(_session["machine"], machine()))
        tr.section(f"The machine: {os.cpu_count()} cores busy {busy:.0f} core-s, idle {idle:.0f}, "
                   f"in {time.monotonic() - _session['wall']:.0f} s")
        tr.write_line(f"this VM's speed: `import torch` took {_session['torch_cpu']:.2f} CPU-s (median of 3, "
                      "before the run)")
        tr.write_line("idle core-s during a test (the other worker's test shares it):")
        for r in sorted(rows, key=lambda r: -r.get("machine_idle", 0))[:5]:
            tr.write_line(f"{r.get('machine_idle', 0):7.1f} idle {r['wall']:7.1f} wall  {r['id']}")
    tr.section(f"CPU seconds per file (tests and the processes they reaped): {sum(cpu.values()):.0f} in all")
    for path, c in cpu.most_common(TOP):
        tr.write_line(f"{c:7.1f} cpu {wall[path]:7.1f} wall {count[path]:4d} tests  {path}")
    tr.section("CPU seconds per test")
    for r in sorted(rows, key=lambda r: -r["cpu"])[:TOP]:
        tr.write_line(f"{r['cpu']:7.1f} cpu {r['wall']:7.1f} wall  {r['id']}")
