"""The checks of the hierarchy tests (tests/multirank/test_hierarchy_parity.py, on one host;
tests/system/test_hierarchy_bed.py, on simulated nodes) on tests/workers/hierarchy.py's
JSON; the tolerances are explained in test_hierarchy_parity.py's docstring."""
from __future__ import annotations

from parity_checks import ULP1


def cases(r: dict) -> dict:
    return {k: v for k, v in r.items() if isinstance(v, dict)}


def same(x: dict, y: dict) -> bool:
    """Bitwise the same parameters and losses. The reported norm is a float64 sum of
    per-rank partial norms, which differ when the shards are cut differently (groups of
    2 vs 4): it may differ in its last bits (1e-12 relative here) and still give the same
    float32 clipping coefficient, as the equal parameters show."""
    k = min(len(x["losses"]), len(y["losses"]))  # a resumed run has the last steps only
    return (x["digest"], x["losses"][-k:]) == (y["digest"], y["losses"][-k:]) and \
        all(abs(a - b) <= 1e-12 * b for a, b in zip(x["norms"][-k:], y["norms"][-k:]))


def parity(r: dict, name: str, d: dict) -> None:
    start = len(r["ref_losses"]) - len(d["losses"])  # resumed cases run the second half
    ref_l, ref_n = r["ref_losses"][start:], r["ref_norms"][start:]
    if name.startswith("fp32"):
        tol = 16 * max(r["floor"], ULP1)
        assert d["max_diff"] <= tol, (name, d["max_diff"], tol)
        for x, y in zip(d["norms"], ref_n):
            assert abs(x - y) <= 1e-5 * y, (name, x, y)
        for x, y in zip(d["losses"], ref_l):
            assert abs(x - y) <= 1e-5, (name, x, y)
    else:
        assert max(abs(x - y) for x, y in zip(d["losses"], ref_l)) < 0.03, (name, d["losses"], ref_l)
