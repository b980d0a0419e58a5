"""The hierarchy modes on 2 simulated nodes x 2 ranks (tests/support/netcluster.py: network
namespaces, MPI over TCP between nodes, shared memory inside): the node layout comes
from MPI's shared-memory split, not from ZEROMPI_RANKS_PER_NODE. One launch of
tests/workers/hierarchy.py; the same checks as tests/multirank/test_hierarchy_parity.py."""
from __future__ import annotations

import json

from mpirun import WORKERS, launch
from slurm_jobs import PY
from hierarchy_checks import cases as _cases, parity as _parity, same as _same

CASES = ["fp32/s3/flat", "fp32/s3/two", "fp32/s3/node", "fp32/s3/sec+save", "bf16/s2/two", "bf16/s2/node",
         "fp32/s1/node<fp32/s3/sec"]


def test_modes_on_two_simulated_nodes(net_nodes, tmp_path):
    out, ckpt = tmp_path / "r.json", tmp_path / "ckpt"
    r = launch(net_nodes.mpiexec_argv(ppn=2) + [PY, str(WORKERS / "hierarchy.py"), "--out", str(out),
                                                  "--cases", ",".join(CASES), "--save", str(ckpt),
                                                  "--load", str(ckpt)], timeout=400)
    assert r.returncode == 0, r.stdout[-4000:]
    res = json.loads(out.read_text())
    c = _cases(res)
    assert list(c) == CASES
    for name, d in c.items():
        _parity(res, name, d)
    assert [(c[k]["mode"], c[k]["group"]) for k in ("fp32/s3/flat", "fp32/s3/two", "fp32/s3/node")] == \
        [("flat", 4), ("two-level", 4), ("hybrid", 2)]
    assert "2 per node x 2 nodes" in c["fp32/s3/two"]["describe"] and c["fp32/s3/sec+save"]["secondary_fills"] > 0
    assert _same(c["fp32/s3/sec+save"], c["fp32/s3/flat"]) and _same(c["fp32/s3/two"], c["fp32/s3/node"])
    assert _same(c["bf16/s2/two"], c["bf16/s2/node"])
