"""The 2 nodes x 2 ranks grid that tests/workers/node_grid.py reports, checked the same way
when the nodes are posed on one host (tests/multirank/test_node_grid.py) and when they are
simulated nodes (tests/system/test_multinode_grid.py)."""
from __future__ import annotations

FORCE = "ZEROMPI_RANKS_PER_NODE"


def check_2x2(res: list[dict], names: list[str]) -> None:
    assert [x["rank"] for x in res] == [0, 1, 2, 3]
    for x in res:
        r = x["rank"]
        assert (x["index"], x["local_rank"], x["per_node"], x["count"]) == (r // 2, r % 2, 2, 2), x
        assert x["names"] == names, x
        assert x["node_members"] == [r // 2 * 2, r // 2 * 2 + 1], x
        assert x["cross_members"] == [r % 2, r % 2 + 2], x
        assert x["node_sum"] == sum(m + 1 for m in x["node_members"]), x
        assert x["cross_sum"] == sum(m + 1 for m in x["cross_members"]), x
        assert x["describe"] == "4 ranks on 2 nodes (2 per node" + (", " + FORCE if "#" in names[0] else "") + ")"
        assert x["name_23"] == f"ranks 2-3 (all of node {names[1]})", x
