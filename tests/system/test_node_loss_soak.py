"""Soak (`-m soak`, not in the default suite): the faults of issue 44 repeated, each run
checked as the default suite checks its one run.

- A rank SIGSTOPped at stage 3 while the others wait for a gradient bucket in the loop
  that serves gather rounds: 20 runs in a row, each ending at the deadline with the
  stopped rank named, exit 3, no rank left (tests/system/test_watchdog.py runs it once).
- Node 2 of the simulated 2-node Slurm bed lost (tests/support/node_loss.py: kill, link
  down, power, loss during a background checkpoint write) at timeout_s 8 and 60,
  ZEROMPI_SOAK_RUNS runs in a row each (default 5): every run ends within timeout_s + 30 s
  with a line naming the node (its ranks from the watchdog; kill: the launcher ends the
  job first and the batch script's probe names the node), no crash
  report, nothing left running, and resumes on node 1.
Each test prints one line per run (pytest -s shows them) and fails naming the runs that
did not hold."""
import os

import pytest

from reliability_jobs import stopped_rank_job

RUNS = int(os.environ.get("ZEROMPI_SOAK_RUNS", "5"))


@pytest.mark.soak
def test_stopped_rank_at_stage_3_ends_at_the_deadline_every_time(tmp_path):
    failed = []
    for i in range(20):
        bad = stopped_rank_job(tmp_path / f"run{i}", "stop-in-backward", 3)
        print(f"run {i + 1}/20: {'ok' if not bad else 'FAIL ' + bad[0]}", flush=True)
        if bad:
            failed.append((i + 1, bad))
    assert not failed, f"{len(failed)} of 20 runs failed: " + "; ".join(f"run {i}: {b[0]}" for i, b in failed) \
        + f"\nthe first (run {failed[0][0]}):\n" + "\n".join(failed[0][1]) if failed else ""


@pytest.mark.soak
@pytest.mark.parametrize("timeout_s", [8, 60])
@pytest.mark.parametrize("fault", ["kill", "link-down", "power", "async-write"])
def test_node_loss_repeated(fault, timeout_s, tmp_path):
    from netcluster import available
    from node_loss import lose_node, summary
    from slurm_cluster import slurm_available

    for ok, why in (available(), slurm_available()):
        if not ok:
            pytest.skip(why)
    results = []
    for i in range(RUNS):
        problems, facts = lose_node(fault, timeout_s, tmp_path / f"run{i}")
        results.append((fault, timeout_s, problems, facts))
        print(summary(results[-1:]), flush=True)
    failed = [(i + 1, p) for i, (_, _, p, _) in enumerate(results) if p]
    assert not failed, f"{len(failed)} of {RUNS} runs failed:\n{summary(results)}\n\nthe first (run " \
        f"{failed[0][0]}):\n" + "\n".join(failed[0][1]) if failed else ""
