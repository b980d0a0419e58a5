"""ParallelDims knows the nodes (zerompi/parallel/nodes.py) on one host: node index,
node-local rank, ranks per node, node-local and cross-node groups, with nodes posed by
ZEROMPI_RANKS_PER_NODE or one host as one node (tests/workers/node_grid.py; across
simulated nodes and the uneven layout: tests/system/test_multinode_grid.py)."""
from __future__ import annotations

import socket

from batch import batched, worker
from node_grid_checks import FORCE, check_2x2


@batched(lambda: worker(4, "node_grid", env={FORCE: "2"}, timeout=120))
def test_forced_nodes_on_one_host(result):
    """ZEROMPI_RANKS_PER_NODE=2 at N = 4: two nodes of two consecutive ranks."""
    host = socket.gethostname()
    check_2x2(result, [f"{host}#0", f"{host}#1"])


@batched(lambda: worker(3, "node_grid", timeout=120))
def test_one_host_is_one_node(result):
    for x in result:
        assert (x["index"], x["local_rank"], x["per_node"], x["count"]) == (0, x["rank"], 3, 1), x
        assert x["names"] == [socket.gethostname()] and x["describe"] == "3 ranks on 1 node (3 per node)", x
