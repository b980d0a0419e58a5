"""The batch machinery (tests/support/batch.py, tests/workers/batch.py) on 2 ranks: cases
go on in the same launch after a case that failed on every rank, a case that ends its
launch (one rank raising while its peer waits) or passes its timeout fails alone and the
cases after it run in a new launch, each failure names its case with the tracebacks."""
import types

from batch import Batches, worker


def probe(mode, tag="", **kw):
    return worker(2, "batch_probe", "--mode", mode, "--tag", tag, **kw)


def test_failures_stay_with_their_case(tmp_path):
    cases = [probe("ok", "a", env={"PROBE_ENV": "x"}), probe("raise-all"), probe("ok", "b"),
             probe("raise-one"), probe("ok", "c"), probe("hang", timeout=5), probe("ok", "d"),
             probe("exit")]
    # 2 s for raise-one's peer to reach the end of the case (it never will: it waits in a barrier)
    b = Batches(types.SimpleNamespace(items=[]), tmp_path, plan=cases, env={"BATCH_GRACE_S": "2"})
    out = {c: b.get(c) for c in cases}
    a, b_, c, d = (out[cases[i]].result for i in (0, 2, 4, 6))
    assert [r["tag"] for r in (a, b_, c, d)] == ["a", "b", "c", "d"]
    assert a["env"] == "x" and b_["env"] is None  # a case's env stays with it
    assert a["pid"] == b_["pid"]                   # same launch after a failure on every rank
    assert c["pid"] != b_["pid"] and d["pid"] != c["pid"]  # new launches after the ones that ended
    err = out[cases[1]].error
    assert "--- rank 0:" in err and "--- rank 1:" in err and "probe raised on rank 1" in err, err
    err = out[cases[3]].error
    assert "the launch ended" in err and "probe raised on rank 1 only" in err, err
    assert out[cases[5]].error.startswith("timeout after 5 s"), out[cases[5]].error
    assert "wrote no result" in out[cases[7]].error
    assert b._launches == 3
