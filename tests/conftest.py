"""The suite's tiers, markers and shared fixtures (layout: tests/README.md).

A test's directory is its tier: unit/ runs in this process, multirank/ starts mpiexec
jobs, system/ drives the command lines, Slurm, the installer and failures end to end.
The collection hook turns that, and what a test uses, into the markers of pytest.ini:
  mpi     multirank/, `result` (batched cases), or a module that imports a launcher of
          support/mpirun.py (a test file outside the tiers, too)
  slurm   the `slurm_cluster` or `net_slurm` fixture
  system  system/, or the simulated nodes of `net_nodes`;  gpu: the `cuda` fixture
`bash tests/run.sh --quick` runs what has none of mpi, slurm, system.
"""
import sys
from collections import Counter
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
# The checkout first (in-process imports then see the zerompi the ranks see: mpirun.mpi_env
# puts it on their PYTHONPATH), and tests/support/ by plain name (`from mpirun import ...`).
sys.path[:0] = [str(TESTS.parent), str(TESTS / "support")]

TIER_MARKS = {"multirank": ("mpi",), "system": ("system",)}
FIXTURE_MARKS = {"result": ("mpi",), "ckpt_base": ("mpi",), "slurm_cluster": ("slurm", "system"),
                 "net_nodes": ("system",), "net_slurm": ("slurm", "system"), "cuda": ("gpu",)}
LAUNCHERS = ("run_mpi", "run_worker", "launch", "running_job", "train_job")


def _launches_mpi(module) -> bool:
    import mpirun

    launchers = [getattr(mpirun, n) for n in LAUNCHERS if hasattr(mpirun, n)]
    return any(v is f for v in vars(module).values() for f in launchers)


# Tests that must share a pytest-xdist worker (run.sh: -n 2 --dist loadgroup), by what
# they share: a session's Slurm cluster, its simulated nodes, the base checkpoints, or
# (batched cases) the launches, one after another; every other multirank/ or system/ file
# stays on one worker, so its module fixtures are built once, and so do the tests of a
# unit/ file that use one of its module fixtures (an nvcc-built harness).
FIXTURE_GROUPS = {"slurm_cluster": "slurm", "net_nodes": "netns", "net_slurm": "netns", "ckpt_base": "ckpt"}
OWN_NODES = ("test_multinode_loss.py", "test_node_loss_soak.py")  # build simulated nodes and a Slurm of their own


def _xdist_group(item, rel: tuple) -> str | None:
    for fixture, group in FIXTURE_GROUPS.items():
        if fixture in item.fixturenames:
            return group
    if rel[-1] in OWN_NODES:
        return "netns"
    if "result" in item.fixturenames:  # batched cases: one group (support/batch.py, group_name)
        from batch import cases_of, group_name

        value = cases_of(item)
        return group_name(value) if value is not None else None
    if rel[0] in TIER_MARKS and len(rel) > 1 or _module_fixture(item):
        return "/".join(rel)
    return None


def _module_fixture(item) -> bool:
    """The test uses a module-scoped fixture of its own file (a compiled harness, a
    trained tokenizer): its file's tests then share a worker and build it once."""
    defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
    return any(d[-1].scope == "module" and d[-1].baseid == item.nodeid.split("::")[0]
               for d in defs.values() if d)


def pytest_addoption(parser):
    parser.addoption("--cpu-profile", action="store_true",
                     help="record and print each test's CPU time (tests/support/cpu_profile.py)")


def pytest_configure(config):
    if config.getoption("--cpu-profile"):
        import cpu_profile

        config.pluginmanager.register(cpu_profile, "cpu_profile")
        cpu_profile.start(config)


@pytest.hookimpl(tryfirst=True)  # before xdist's hook reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    for item in items:
        path = Path(str(item.path)).resolve()
        rel = path.relative_to(TESTS).parts if path.is_relative_to(TESTS) else ("",)
        marks = set(TIER_MARKS.get(rel[0], ())) if len(rel) > 1 else set()
        for fixture in item.fixturenames:
            marks.update(FIXTURE_MARKS.get(fixture, ()))
        if item.module is not None and _launches_mpi(item.module):
            marks.add("mpi")
        if rel[0] == "unit" and marks & {"mpi", "slurm", "system"}:
            raise pytest.UsageError(f"{item.nodeid} is in tests/unit/ but needs {sorted(marks)}: "
                                    "move it to tests/multirank/ or tests/system/")
        for m in sorted(marks):
            item.add_marker(m)
        group = _xdist_group(item, rel)
        if group:
            item.add_marker(pytest.mark.xdist_group(group))
    if "soak" not in (config.getoption("markexpr") or ""):
        # Soak tests (the same fault N times in a row, long deadlines) run only when asked
        # for by `-m soak`; the suite's budget has no room for them.
        kept = [i for i in items if i.get_closest_marker("soak") is None]
        if len(kept) != len(items):
            config.hook.pytest_deselected(items=[i for i in items if i.get_closest_marker("soak")])
            items[:] = kept
    if hasattr(config, "workerinput"):  # an xdist worker: the order the controller hands out
        items[:] = _worker_order(items)


# The batched launches (one group: support/batch.py, group_name) go to the head of the
# queue beside the groups that wait (Slurm's 30 s time-limit checks; a lost node declared
# down after 30 s): one worker runs the launches one after another, largest world size
# first, while the other takes slurm, then netns, whose jobs mostly sleep. Launches side
# by side (the earlier layout, one group per world size) cost more CPU than one after
# another: ranks poll while a peer is descheduled (docs/performance.md, "The test
# suite"). The rest keeps xdist's own order (most tests per group first; run.sh passes
# --no-loadscope-reorder so that this order stands).
HEAD = ("batch", "slurm", "netns")


def _worker_order(items: list) -> list:
    from batch import launch_group, size_of

    scopes = [launch_group(i) or i.nodeid for i in items]
    count, first = Counter(scopes), {}
    for k, sc in enumerate(scopes):
        first.setdefault(sc, k)
    key = {sc: (HEAD.index(sc) if sc in HEAD else len(HEAD), -count[sc], first[sc]) for sc in first}
    within = [-size_of(i) if sc == "batch" else 0 for sc, i in zip(scopes, items)]
    order = sorted(range(len(items)), key=lambda k: (key[scopes[k]], within[k], k))
    return [items[k] for k in order]


@pytest.fixture
def cuda():
    """Skips unless torch sees a CUDA device; tests that take it are marked `gpu`."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device visible (torch.cuda.is_available() is False)")
    return torch.device("cuda", 0)


@pytest.fixture(scope="session")
def batches(request, tmp_path_factory):
    """The session's batched multi-rank cases, one launch per world size (support/batch.py)."""
    from batch import Batches

    return Batches(request.session, tmp_path_factory.mktemp("batches"))


@pytest.fixture
def result(request, batches):
    """The results of the cases this test declares with @pytest.mark.batched(make)."""
    return batches.results_for(request.node)


@pytest.fixture(scope="session")
def slurm_cluster():
    """A private single-node Slurm cluster on 127.0.0.1 (see support/slurm_cluster.py).

    Skips when Slurm/munge are not installed (.ci/install_debian.sh) or we are not root;
    fails if they are installed but the cluster does not come up.
    """
    from slurm_cluster import SlurmCluster, slurm_available

    ok, why = slurm_available()
    if not ok:
        pytest.skip(why)
    # The context manager stops every daemon and cancels jobs even when tests fail.
    with SlurmCluster() as cluster:
        yield cluster


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """A 300 kB slice of the bundled corpus, tokenized once for the train-CLI tests."""
    from zerompi.data import default_corpus

    return str(default_corpus(tmp_path_factory.mktemp("cache"), max_bytes=300_000))


@pytest.fixture(scope="session")
def ckpt_base(tmp_path_factory):
    """Checkpoints of every stage and bf16 plus their uninterrupted runs, built once for
    test_checkpoint.py and test_checkpoint_faults.py (checkpoint_cases.base_checkpoints)."""
    from checkpoint_cases import base_checkpoints

    return base_checkpoints(tmp_path_factory.mktemp("base"))


@pytest.fixture(scope="session")
def net_nodes():
    """Two simulated nodes (tests/support/netcluster.py), unshaped until a test shapes them.
    Skips with the reason where it cannot run (not root, no `ip netns`)."""
    from netcluster import NetCluster, available

    ok, why = available()
    if not ok:
        pytest.skip(why)
    with NetCluster(nodes=2, rate_mbit=None) as net:
        yield net


@pytest.fixture(scope="session")
def net_slurm(net_nodes):
    """Slurm across net_nodes (tests/support/netslurm.py): one slurmctld, one slurmd per node."""
    from netslurm import NetSlurm
    from slurm_cluster import slurm_available

    ok, why = slurm_available()
    if not ok:
        pytest.skip(why)
    with NetSlurm(net_nodes) as cluster:
        yield cluster


def pytest_xdist_node_collection_finished(node, ids):
    """On the controller of `--dist loadgroup`: xdist appends "@group" to the node id of
    each test with an xdist_group mark (every multirank/ and system/ test has one), and
    keeps a group on one worker by that suffix. Where none came back (pytest 9.2 with
    xdist 3.8: setup.py pins pytest below it), every group would be split across the
    workers: the batched launches would run on each, the session fixtures (a Slurm cluster)
    be built on each: stop."""
    if node.config.getvalue("dist") != "loadgroup" or any("@" in i for i in ids):
        return
    tiered = [i for i in ids if i.startswith(("tests/multirank/", "tests/system/"))]
    if tiered:
        from importlib.metadata import version

        raise pytest.UsageError(
            f"pytest {version('pytest')} with pytest-xdist {version('pytest-xdist')} does not apply "
            f"xdist_group (no '@group' on {tiered[0]}): install the test extra's pytest "
            "(pip install -e '.[test]'; bash tests/run.sh does)")


def pytest_collection_finish(session):
    """Everything collection imported (torch, transformers, the test modules) lives until
    the end: frozen, so the automatic collections of the in-process tests stop walking it
    (Python's cyclic GC over a torch + transformers heap costs 0.1-0.2 s a full pass)."""
    import gc

    gc.collect()
    gc.freeze()
