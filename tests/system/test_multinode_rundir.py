"""A run directory that the nodes do not share (zerompi/checkpoint/shared.py): node 2
sees a node-private tmpfs over it (tests/support/netcluster.py private_dirs), as a node-local
disk would give. The first save stops the job with one message naming the nodes, exit
2, and leaves nothing behind."""
from __future__ import annotations

from multinode_jobs import train_mpiexec, write_config


def test_run_dir_not_shared_is_one_message_and_nothing_left(net_nodes, tmp_path):
    net = net_nodes
    cfg = write_config(tmp_path / "fast.toml", max_steps=2)
    private = tmp_path / "private"
    # (A shared directory passes the same check without a trace: test_multinode_slurm.py.)
    net.set_private_dirs([private], nodes=[net.nodes[1]])
    try:
        r = train_mpiexec(net, cfg, private)
    finally:
        net.set_private_dirs([])
    assert r.returncode == 2, r.stdout[-3000:]
    errors = [ln for ln in r.stdout.splitlines() if "error" in ln.lower()]
    assert len(errors) == 1, r.stdout[-3000:]
    assert errors[0] == (
        f"zerompi.train: error: checkpoint directory {private / 'checkpoints'} is not shared by the nodes: "
        f"{net.nodes[1]} (ranks 2-3) cannot see the files that {net.nodes[0]} (ranks 0-1) writes there. "
        "Every node must see the same run directory (--run_dir on a parallel or network file system, "
        "not a node-local disk); nothing was saved"), errors[0]
    assert "Traceback" not in r.stdout
    # Node 1 (rank 0) sees the host's directory: no checkpoint, no temporary directory.
    assert list((private / "checkpoints").iterdir()) == [], list((private / "checkpoints").iterdir())
