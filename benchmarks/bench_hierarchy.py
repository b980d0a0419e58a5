"""Hierarchy modes on a simulated cluster: bytes across the inter-node link per step
against the estimator's prediction, and stage-3 step times against flat stage 3.

    python benchmarks/bench_hierarchy.py [--rate-mbit 100] [--repeats 2] [--out results/hierarchy]

2 nodes x 2 ranks (tests/support/netcluster.py: network namespaces, MPI over TCP between nodes
and shared memory inside, each node's egress shaped by tc tbf to --rate-mbit). Each run
is one mpiexec of hierarchy_worker.py (a 4.84M-parameter GPT, fp32, one 64-token sequence
per rank): warm-up steps, then the driver reads both nodes' veth counters around the
measured steps (a file handshake, see the worker). Bytes per step = the bytes both nodes
sent into the link / steps; the prediction is the estimator's for the same model, config
and 2 x 2 grid (api.size(..., ranks_per_node=2): the run's own mode across nodes,
cross_bytes_total, checked to be the mode the engine ran). Stage-3 runs are repeated, in
rotation, for the step times; flat stage 3 also runs on the unshaped link, to show it is
communication-bound at the shaped one. Needs root (network namespaces). Every namespace
and process the cluster creates is removed on exit, also on error or Ctrl-C.
`--repredict results/hierarchy.json` recomputes a results file's predictions from its
stored runs (stage, mode, precision), measurements untouched.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_env import ROOT, machine_info, software_info

sys.path.insert(0, str(ROOT / "tests" / "support"))
from netcluster import NetCluster  # noqa: E402

HERE = Path(__file__).resolve().parent
MODES = {  # name -> zero.* settings
    "flat": {"comm": {"hierarchical": "off"}},
    "two-level": {"comm": {"hierarchical": "on"}},
    "hybrid node": {"shard_group": "node"},
    "secondary": {"comm": {"hierarchical": "off"}, "stage3": {"secondary_partition": "node"}},
    "secondary + two-level": {"comm": {"hierarchical": "on"}, "stage3": {"secondary_partition": "node"}},
}
MACHINE = "vm (2-core AMD EPYC VM, 24 GiB, Debian 12)"


def _predicted(stage: int, mode: str, precision: str) -> dict:
    """The estimator's prediction for the run's own mode on 2 nodes x 2 ranks."""
    sys.path.insert(0, str(ROOT))
    from zerompi.config import load
    from zerompi.estimate import api
    from zerompi.estimate.models import from_shape
    from zerompi.models.gpt import GPTConfig

    cfg = GPTConfig(vocab_size=256, block_size=128, n_layer=6, n_head=8, n_embd=256)  # hierarchy_worker.CFG
    zc = load({"precision": precision, **MODES[mode]})
    run = api.size(from_shape("bench-hierarchy", cfg), [4], [stage], zero=zc, ranks_per_node=2, link="ndr-ib",
                   modes={})["runs"][0]
    d = run["nodes"]
    return {"params": run["params"], "mode": d["mode"], "cross_bytes_total": d["cross_bytes_total"],
            "node_link_bytes": d["node_link_bytes"], "intra_bytes_total": d["intra_bytes_per_rank"] * 4,
            "per_rank_bytes": d["per_rank_bytes"], "rows": d["rows"]}


def _with_prediction(r: dict) -> dict:
    pred = _predicted(r["stage"], r["name"], r["precision"])
    if pred["params"] != r["params"]:
        raise RuntimeError(f"the estimator's model has {pred['params']} parameters, the worker's {r['params']}")
    if pred["mode"] != r["mode"]:
        raise RuntimeError(f"{r['name']}: the engine ran {r['mode']}, the estimator predicts {pred['mode']}")
    r.update(predicted_cross_bytes=pred["cross_bytes_total"], predicted_rows=pred["rows"],
             ratio=r["cross_bytes_per_step"] / pred["cross_bytes_total"])
    return r


def run_one(net: NetCluster, work: Path, tag: str, stage: int, mode: str, precision: str,
            warmup: int, steps: int, timeout: float) -> dict:
    argv = net.mpiexec_argv(ppn=2) + [sys.executable, str(HERE / "hierarchy_worker.py"), "--dir", str(work),
                                      "--tag", tag, "--stage", str(stage), "--precision", precision,
                                      "--mode", json.dumps(MODES[mode]), "--warmup", str(warmup),
                                      "--steps", str(steps)]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for k in [k for k in env if k.startswith(("MALLOC_", "GLIBC_TUNABLES"))]:
        del env[k]
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                         start_new_session=True)
    counters, t0 = [], time.monotonic()
    try:
        for i in range(2):
            mark = work / f"{tag}.mark{i}"
            while not mark.exists():
                if p.poll() is not None:
                    raise RuntimeError(f"{tag}: job ended (exit {p.returncode}) before mark {i}:\n"
                                       + p.stdout.read()[-3000:])
                if time.monotonic() - t0 > timeout:
                    raise TimeoutError(f"{tag}: no mark {i} after {timeout} s")
                time.sleep(0.01)
            counters.append(net.link_bytes())
            (work / f"{tag}.ack{i}").touch()
        out, _ = p.communicate(timeout=max(10.0, timeout - (time.monotonic() - t0)))
        if p.returncode:
            raise RuntimeError(f"{tag}: exit {p.returncode}\n{out[-3000:]}")
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    res = json.loads((work / f"{tag}.json").read_text())
    (a, b) = counters
    tx = {n: (b[n][1] - a[n][1]) / steps for n in net.nodes}
    rx = {n: (b[n][0] - a[n][0]) / steps for n in net.nodes}
    return dict(res, tx_per_step=tx, rx_per_step=rx, cross_bytes_per_step=sum(tx.values()))


@contextlib.contextmanager
def _removed(path: Path):
    """The handshake files go with the run, whatever happens."""
    try:
        yield
    finally:
        shutil.rmtree(path, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate-mbit", type=float, default=100.0)
    ap.add_argument("--repeats", type=int, default=2, help="rounds of the stage-3 runs (step times)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--out", default=str(HERE / "results" / "hierarchy"))
    ap.add_argument("--repredict", help="a results JSON whose predictions to recompute (in place)")
    ap.add_argument("--note", default="", help="with --repredict: why (appended to the JSON's notes)")
    a = ap.parse_args()
    if a.repredict:
        return _repredict(Path(a.repredict), a.note)
    plan = [(3, m, a.rate_mbit) for _ in range(a.repeats) for m in MODES]
    plan += [(2, m, a.rate_mbit) for m in ("flat", "two-level", "hybrid node")]
    plan += [(3, "flat", None)]
    runs = []
    t_start = time.time()
    work = Path(tempfile.mkdtemp(prefix="bench-hier-"))
    with NetCluster(nodes=2, rate_mbit=a.rate_mbit) as net, _removed(work):
        for i, (stage, mode, rate) in enumerate(plan):
            for node in net.nodes:
                net.shape(node, rate_mbit=rate or 0)
            tag = f"r{i}"
            r = run_one(net, work, tag, stage, mode, a.precision, a.warmup, a.steps, a.timeout)
            r.update(stage=stage, name=mode, rate_mbit=rate, precision=a.precision)
            runs.append(_with_prediction(r))
            print(f"stage {stage} {mode:22s} rate {rate}: {r['cross_bytes_per_step'] / 1e6:8.2f} MB/step across "
                  f"(predicted {r['predicted_cross_bytes'] / 1e6:8.2f}, ratio {r['ratio']:.3f}), step "
                  f"{statistics.median(r['step_seconds']):.3f} s", flush=True)
    summary = _summary(runs, a.rate_mbit)
    out = {"benchmark": "bench_hierarchy", "machine": MACHINE, "machine_info": machine_info(),
           "software": software_info(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
           "seconds": time.time() - t_start,
           "cluster": {"nodes": 2, "ranks_per_node": 2, "link": f"veth + tc tbf {a.rate_mbit:g} Mbit/s egress per "
                       "node (burst max(128 KiB, 1 ms)), MPICH ch4:ucx tcp between nodes, shared memory inside"},
           "args": vars(a), "summary": summary, "runs": runs}
    Path(a.out + ".json").write_text(json.dumps(out, indent=1, default=float))
    from plot_hierarchy import plot

    plot(out, a.out + ".png")
    print(json.dumps(summary, indent=1))
    return 0


def _repredict(path: Path, note: str) -> int:
    from plot_hierarchy import plot

    res = json.loads(path.read_text())
    for r in res["runs"]:
        _with_prediction(r)
    res["summary"] = _summary(res["runs"], res["args"]["rate_mbit"])
    res.setdefault("notes", []).append(f"{time.strftime('%Y-%m-%d')}: predictions recomputed by --repredict. "
                                       f"{note}".strip())
    path.write_text(json.dumps(res, indent=1, default=float))
    plot(res, str(path.with_suffix(".png")))
    print(json.dumps(res["summary"], indent=1))
    return 0


def _summary(runs: list[dict], rate: float) -> dict:
    shaped3 = [r for r in runs if r["stage"] == 3 and r["rate_mbit"] == rate]
    med = lambda name: statistics.median(t for r in shaped3 if r["name"] == name  # noqa: E731
                                         for t in r["step_seconds"])
    unshaped = [r for r in runs if r["rate_mbit"] is None]
    flat = med("flat")
    return {
        "bytes_within_10pct": all(abs(r["ratio"] - 1) <= 0.10 for r in runs),
        "ratios": {f"s{r['stage']} {r['name']}" + ("" if r["rate_mbit"] else " unshaped"): round(r["ratio"], 4)
                   for r in runs},
        "step_seconds": {m: med(m) for m in MODES},
        "flat_unshaped_step_seconds": statistics.median(unshaped[0]["step_seconds"]) if unshaped else None,
        "speedup_secondary": flat / med("secondary"), "speedup_hybrid_node": flat / med("hybrid node"),
        "speedup_two_level": flat / med("two-level"),
        "speedup_secondary_two_level": flat / med("secondary + two-level"),
        "goals": {"secondary >= 1.3x": flat / med("secondary") >= 1.3,
                  "hybrid node >= 1.5x": flat / med("hybrid node") >= 1.5},
    }


if __name__ == "__main__":
    sys.exit(main())
