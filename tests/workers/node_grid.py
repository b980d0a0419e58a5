"""Where the ranks run, as ParallelDims sees it (tests/multirank/test_node_grid.py,
tests/system/test_multinode_grid.py): node index, node-local rank, ranks per node, node
names, the members of the node-local and cross-node groups (as world ranks), and a sum
over each group."""
from zerompi.runtime import pause_collector; pause_collector()  # until freeze_startup_heap: runtime/pygc.py
import argparse
import json
import socket

import torch

from zerompi.parallel import ParallelDims
import zerompi.runtime
zerompi.runtime.freeze_startup_heap()  # as zerompi.train does (runtime/pygc.py)

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
a = ap.parse_args()

dims = ParallelDims.create()
L = dims.nodes
x = torch.tensor([float(dims.rank + 1)])
dims.node.all_reduce(x)
y = torch.tensor([float(dims.rank + 1)])
dims.cross_node.all_reduce(y)
res = {"rank": dims.rank, "host": socket.gethostname(), "index": L.index, "local_rank": dims.local_rank,
       "per_node": L.per_node, "count": L.count, "names": list(L.names), "describe": L.describe(),
       "node_members": dims.node.allgather_object(dims.rank),
       "cross_members": dims.cross_node.allgather_object(dims.rank),
       "node_sum": x.item(), "cross_sum": y.item(), "name_23": L.name_ranks([2, 3]) if L.count > 1 else ""}
everyone = dims.world.allgather_object(res)
if dims.rank == 0:
    with open(a.out, "w") as f:
        json.dump(everyone, f)
