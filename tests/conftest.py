import pytest


@pytest.fixture(scope="session")
def slurm_cluster():
    """A private single-node Slurm cluster on 127.0.0.1 (see tests/slurm_cluster.py).

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
    """Two simulated nodes (tests/netcluster.py), unshaped until a test shapes them.
    Skips with the reason where it cannot run (not root, no `ip netns`)."""
    from netcluster import NetCluster, available

    ok, why = available()
    if not ok:
        pytest.skip(why)
    with NetCluster(nodes=2, rate_mbit=None) as net:
        yield net


@pytest.fixture(scope="session")
def net_slurm(net_nodes):
    """Slurm across net_nodes (tests/netslurm.py): one slurmctld, one slurmd per node."""
    from netslurm import NetSlurm
    from slurm_cluster import slurm_available

    ok, why = slurm_available()
    if not ok:
        pytest.skip(why)
    with NetSlurm(net_nodes) as cluster:
        yield cluster
