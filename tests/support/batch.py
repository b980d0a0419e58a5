"""Many multi-rank cases in one mpiexec launch per world size.

A launch costs seconds before any test code runs (MPI start-up, then torch, and for the
zoo transformers, imported on every rank), more than most cases take. So a test declares
the cases it reads, as a function of its parameters:

    @batched(lambda n: Case(n, "parity", ("--model", "odd")))
    @pytest.mark.parametrize("n", [1, 2, 3, 4])
    def test_parity(n, result): ...

and takes the `result` fixture (conftest.py). The first time a test needs a world size,
the cases of every selected test at that size run in one launch of tests/workers/batch.py;
each test then asserts its own case, and a failed case fails its own test, named, with its
traceback. A case that hangs is killed at its own timeout; a case that ends its launch
(a rank's exception while a peer waits, an abort, a crash) fails alone: the cases after
it run in a new launch. Equal cases (same worker, world size, arguments) run once.
"""
from __future__ import annotations

import inspect
import json
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from mpirun import WORKERS, launch_cap, mpi_env, shm_cleanup
from zerompi.runtime import jobs

STARTUP_S = 180.0  # before the first case starts: mpiexec, MPI_Init, imports on a loaded machine
# Launch-wide environment: transformers' logging level is read once, at import.
LAUNCH_ENV = {"TRANSFORMERS_VERBOSITY": "error"}


@dataclass(frozen=True)
class Case:
    """`mpiexec -n N python -m mpi4py tests/workers/WORKER.py --out OUT ARGS`, as one case
    of a batch. In ARGS, {tmp} is the session's batch directory (shared by all cases: a
    checkpoint one case saves for another that `needs` it) and {dir} a fresh directory of
    this case's own, into which `copy` (name, source directory) pairs are copied first.
    `env` is set on every rank around the case (variables read at run time)."""
    n: int
    worker: str
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    needs: tuple["Case", ...] = ()
    copy: tuple[tuple[str, str], ...] = ()
    timeout: float = field(default=180.0, compare=False)

    @property
    def name(self) -> str:
        env = "".join(f"{k}={v} " for k, v in self.env)
        return f"{env}n{self.n} {self.worker} {shlex.join(self.args)}".rstrip()


def batched(make):
    """@batched(make): the cases a test reads through the `result` fixture, make(**the
    test's parameters) -> a Case or a tuple of them. (pytest.mark.batched(f) would take a
    named function f for the test itself; with_args keeps it an argument.)"""
    return pytest.mark.batched.with_args(make)


def worker(n: int, name: str, *args: str, timeout: float = 180, env: dict | None = None,
           needs: tuple = (), copy: dict | None = None) -> Case:
    """tests/workers/NAME.py on n ranks, as a batched case."""
    return Case(n, name, tuple(args), tuple(sorted((env or {}).items())), tuple(needs),
                tuple(sorted((k, str(v)) for k, v in (copy or {}).items())), timeout)


def cases_of(item) -> tuple | Case | None:
    """What @pytest.mark.batched(make) gives for this test's parameters."""
    mark = item.get_closest_marker("batched")
    if mark is None or _skipped(item):
        return None
    make = mark.args[0]
    params = getattr(item, "callspec", None)
    params = params.params if params else {}
    return make(**{k: params[k] for k in inspect.signature(make).parameters})


def sizes(value) -> set[int]:
    """World sizes of cases_of()'s cases and of what they need."""
    return {n for c in _flat(value) for n in ({c.n} | sizes(c.needs))}


def group_name(value) -> str:
    """The pytest-xdist group of a test with these cases (conftest.py): one group for
    every batched test, so that one worker runs the launches one after another (a launch
    beside another costs more CPU than alone: ranks poll while a peer is descheduled) and
    a case that needs another size's case (a resume at another N) finds it done in the
    same session's Batches instead of a launch of its own."""
    return "batch"


def size_of(item) -> int:
    """The largest world size among a test's cases (0: not batched): conftest.py runs the
    batch group's tests largest first, so that a smaller launch finds the checkpoints a
    larger one saved for it."""
    value = cases_of(item)
    return max(sizes(value), default=0) if value is not None else 0


def launch_group(item) -> str | None:
    mark = item.get_closest_marker("xdist_group")
    return mark.args[0] if mark is not None and mark.args else None


def _skipped(item) -> bool:
    """Skipped by a mark whose condition is already decided (skip, skipif(True, ...))."""
    if item.get_closest_marker("skip") is not None:
        return True
    return any(m.args and m.args[0] is True or m.kwargs.get("condition") is True
               for m in item.iter_markers("skipif"))


def _flat(value) -> list[Case]:
    return [value] if isinstance(value, Case) else [c for v in value for c in _flat(v)]


class Outcome:
    def __init__(self, result=None, error: str | None = None):
        self.result, self.error = result, error


class Batches:
    """The session's batches: runs a world size's selected cases on first need."""

    def __init__(self, session, root: Path, plan: list[Case] | None = None, env: dict | None = None):
        """`plan`: the cases to run instead of those of session.items (the machinery's own
        tests); `env`: more launch environment."""
        self.session, self.root = session, root
        self.done: dict[Case, Outcome] = {}
        self.timeouts: dict[Case, float] = {c: c.timeout for c in plan or ()}
        self._given = list(plan) if plan is not None else None
        self._planned: dict[str | None, list[Case]] = {}  # per xdist group (launch_group)
        self.env = {**LAUNCH_ENV, **(env or {})}
        self._launches = 0

    def results_for(self, item):
        """This test's results in the shape its batched() function returned; fails the
        test naming the case if one failed."""
        value = cases_of(item)
        if value is None:
            raise pytest.UsageError(f"{item.nodeid} takes `result` without @pytest.mark.batched")
        group = launch_group(item)
        for case in _flat(value):
            out = self.get(case, group)
            if out.error is not None:
                pytest.fail(f"case `{case.name}` failed:\n{out.error}", pytrace=False)
        return self._shape(value)

    def _shape(self, value):
        if isinstance(value, Case):
            return self.done[value].result
        return tuple(self._shape(v) for v in value)

    def get(self, case: Case, group: str | None = None) -> Outcome:
        if case not in self.done:
            for d in case.needs:  # built from existing cases, so the needs never form a cycle
                self.get(d, group)
            if case not in self.done:
                self._run_size(case, group)
        return self.done[case]

    # ------------------------------------------------------------------ planning
    def _plan(self, group: str | None) -> list[Case]:
        """Every case the selected tests of `group` declare, a case's `needs` before it.
        A pytest-xdist worker runs whole groups, so planning another group's cases would
        run them twice, once on each worker."""
        if self._given is not None:
            return self._given
        if group not in self._planned:
            order: dict[Case, None] = {}

            def add(c: Case):
                for d in c.needs:
                    add(d)
                order.setdefault(c)
                self.timeouts[c] = max(self.timeouts.get(c, 0.0), c.timeout)

            for item in self.session.items:
                value = cases_of(item) if launch_group(item) == group else None
                if value is not None:
                    for c in _flat(value):
                        add(c)
            self._planned[group] = list(order)
        return self._planned[group]

    def _run_size(self, case: Case, group: str | None) -> None:
        """One launch (more after a case that ends one) of every planned case of this
        world size whose needs are met: done, or earlier in the same launch."""
        plan = self._plan(group)
        if case not in plan:  # not seen at collection (cannot happen with batched tests)
            plan.append(case)
            self.timeouts.setdefault(case, case.timeout)
        group: list[Case] = []
        for c in plan:  # plan order: a need comes before what needs it
            if c.n != case.n or c in self.done:
                continue
            failed = [d for d in c.needs if d in self.done and self.done[d].error is not None]
            if failed:
                self.done[c] = Outcome(error=f"it needs case `{failed[0].name}`, which failed")
            elif all(d in self.done or d in group for d in c.needs):
                group.append(c)
        while group:
            group = self._launch(case.n, group)

    # ------------------------------------------------------------------ launching
    def _launch(self, n: int, cases: list[Case]) -> list[Case]:
        """One launch; returns the cases it did not reach (after one that ended it)."""
        self._launches += 1
        d = self.root / f"n{n}-launch{self._launches}"
        d.mkdir(parents=True)
        plan = []
        for i, c in enumerate(cases):
            own = d / f"case{i}"
            own.mkdir()
            for name, src in c.copy:
                shutil.copytree(src, own / name)
            args = [a.replace("{tmp}", str(self.root)).replace("{dir}", str(own)) for a in c.args]
            plan.append({"name": c.name, "worker": c.worker, "args": args, "env": dict(c.env),
                         "out": str(d / f"case{i}.json")})
        (d / "plan.json").write_text(json.dumps(plan, indent=1))
        progress, log = d / "progress", d / "output.log"
        cmd = ["mpiexec", "-n", str(n), sys.executable, "-m", "mpi4py", str(WORKERS / "batch.py"),
               str(d / "plan.json"), str(progress)]
        with shm_cleanup(), open(log, "w") as out:
            p = jobs.start(cmd, mpi_env(self.env, cmd), stdout=out)
            try:  # an interrupt of pytest misses the launch (a session of its own): end it too
                timed_out = self._watch(p, progress, [launch_cap(self.timeouts[c]) for c in cases])
            except BaseException:
                _kill(p)
                raise
        started, ended = _read_progress(progress)
        text = log.read_text(errors="replace")
        for i, c in enumerate(cases):
            if i in ended:
                self.done[c] = self._finished(plan[i], p.returncode, ended[i] - started[i])
        last = max(started, default=-1)
        if last < 0:  # died before its first case: nothing to go on with
            for c in cases:
                self.done[c] = Outcome(error=f"the launch ended (exit {p.returncode}) before its first case:\n"
                                             f"{' '.join(cmd)}\n{text[-6000:]}")
            return []
        if last not in ended:  # the case that ended the launch
            why = (f"timeout after {timed_out:.0f} s" if timed_out is not None
                   else f"the launch ended (exit {p.returncode}) during this case")
            self.done[cases[last]] = Outcome(error=f"{why}\n{_errors(plan[last])}"
                                             f"--- output of the case:\n{_section(text, last)[-6000:]}")
        elif len(ended) == len(cases) and p.returncode != 0:  # every case ended, then the launch failed
            for c in cases:
                self.done[c] = Outcome(error=f"the launch exited {p.returncode} after its last case:\n"
                                             f"{text[-6000:]}")
        return cases[last + 1:]  # not reached: a new launch

    def _finished(self, case: dict, code: int, seconds: float) -> Outcome:
        err = _errors(case)
        if err:
            return Outcome(error=err)
        try:
            return Outcome(result=json.loads(Path(case["out"]).read_text()))
        except (OSError, ValueError) as e:
            return Outcome(error=f"the case wrote no result ({e}) in {seconds:.1f} s")

    @staticmethod
    def _watch(p: subprocess.Popen, progress: Path, timeouts: list[float]) -> float | None:
        """Wait for the launch; kill it when the running case passes its timeout (or the
        start-up passes STARTUP_S). Returns the timeout that killed it, if one did."""
        t0 = time.monotonic()
        while p.poll() is None:
            time.sleep(0.2)
            started, ended = _read_progress(progress)
            running = [i for i in started if i not in ended]
            if running:
                limit, since = timeouts[running[0]], started[running[0]]
            else:
                limit, since = STARTUP_S, (max(ended.values()) if ended else None)
            now = time.time()
            if (since is None and time.monotonic() - t0 > STARTUP_S) or (since is not None and now - since > limit):
                _kill(p)
                return limit
        return None


def _kill(p: subprocess.Popen) -> None:
    """The shared launcher's kill: the launch's process group and every process descended
    from it (the ranks run in process groups of their own)."""
    jobs.kill_job(p)
    p.wait()


def _read_progress(path: Path) -> tuple[dict[int, float], dict[int, float]]:
    """Rank 0's lines `start I T` / `end I T` (T: time.time() on that rank)."""
    started, ended = {}, {}
    try:
        lines = path.read_text().split("\n")[:-1]  # whole lines only: rank 0 may be writing
    except OSError:
        return started, ended
    for line in lines:
        parts = line.split()
        if len(parts) == 3:
            (started if parts[0] == "start" else ended)[int(parts[1])] = float(parts[2])
    return started, ended


def _errors(case: dict) -> str:
    """The tracebacks the case's ranks recorded (OUT.err.rRANK), rank by rank."""
    out = Path(case["out"])
    files = sorted(out.parent.glob(out.name + ".err.r*"), key=lambda p: int(p.name.rsplit("r", 1)[1]))
    return "".join(f"--- rank {f.name.rsplit('r', 1)[1]}:\n{f.read_text()}" for f in files)


def _section(text: str, i: int) -> str:
    """The launch's output from case i's start marker (tests/workers/batch.py) on."""
    start = text.find(f"[batch] case {i}:")
    return text if start < 0 else text[start:]
