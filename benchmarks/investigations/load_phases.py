#!/usr/bin/env python
"""Where a verified checkpoint load spends its time, per phase, at N = 1 and N = 4, and
the machine's own ceilings (disk bandwidth, CRC-32 and page-cache copy speed per core).

    python benchmarks/investigations/load_phases.py --driver --machine vm \
        --out benchmarks/investigations/results/checkpoint_load_phases.json [--before /tmp/zerompi-before]

Same state and method as bench_checkpoint.py (135.0M-parameter GPT, fp32 + AdamW, stage 2,
1.62 GB; cold loads after dropping the page cache, checksums verified). The worker wraps
the loader's steps with timers: wall seconds (the slowest rank), and CPU seconds summed
over the ranks (getrusage: all threads; "sys" is the kernel's share: page-cache fills and
copies, MPICH's cross-process copies). Jobs alternate N = 1 and N = 4 (ABBA), and each
records the load average before and after.

On a VM whose freed memory goes back to the host (free page reporting, about 2 s after it
is freed) a cold load has two regimes. Repeats after the first refill the page cache from
the pages the previous repeat's cache left free just before (cheap); with --settle 5 the
freed memory has gone back to the host, as before a fresh job's load, and every new
page-cache page is a fault to the hypervisor (system time of the verify pass, which more
ranks do not shrink).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import resource
import statistics
import subprocess
import sys
import time
import zlib
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # benchmarks/: this study sits one folder down
import bench_checkpoint as bc  # noqa: E402
from bench_env import ROOT  # noqa: E402
from launch import launch  # noqa: E402

_PH: dict = {}


def _usage() -> tuple[float, float]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime


def _timed(owner, attr: str, label: str) -> None:
    orig = getattr(owner, attr)

    def run(*args, **kw):
        t0, (u0, s0) = time.perf_counter(), _usage()
        try:
            return orig(*args, **kw)
        finally:
            (u1, s1), p = _usage(), _PH.setdefault(label, [0.0, 0.0, 0.0])
            p[0] += time.perf_counter() - t0
            p[1] += u1 - u0 + s1 - s0
            p[2] += s1 - s0
    setattr(owner, attr, run)


def worker(a) -> None:
    sys.path.insert(0, a.root)  # the side under test (--before ROOT in the driver)
    from mpi4py import MPI

    import zerompi
    from zerompi.checkpoint import format as fmt
    from zerompi.checkpoint import load, loading, save
    from zerompi.checkpoint import reader as rd
    from zerompi.checkpoint import verify as ver
    from zerompi.comm.mpi import MPICommunicator

    comm = MPI.COMM_WORLD
    model = bc.build_model(a.model, a.vocab)
    engine = zerompi.initialize(model, {"stage": 2, "precision": "fp32", "optimizer": {"lr": 1e-4}})
    bc.one_step(engine, engine.backward, engine.step, model.config.vocab_size)
    for owner, attr, label in ((loading, "_locate", "locate manifest (rank 0 + bcast)"),
                               (ver, "check_files", "verify: read + CRC-32 of own share"),
                               (MPICommunicator, "barrier", "sleeping barriers (skew)"),
                               (fmt, "raise_agreed", "agreements (allgather)"),
                               (rd.PieceReader, "rank_state", "metadata of rank files"),
                               (rd.PieceReader, "read", "piece reads (page cache -> engine)"),
                               (engine.param_store, "after_update", "all-gather of working params"),
                               (engine, "_zero_grads", "zero gradients")):
        _timed(owner, attr, label)
    save(engine, a.dir, tag="phases", keep_last=1)
    reps = []
    for _ in range(a.repeats):
        _PH.clear()
        if comm.rank == 0:
            bc.drop_caches()
            time.sleep(a.settle)
        comm.Barrier()
        t0, (u0, s0) = time.perf_counter(), _usage()
        load(engine, a.dir, verify=True)
        (u1, s1), t1 = _usage(), time.perf_counter()
        _PH["load() total"] = [t1 - t0, u1 - u0 + s1 - s0, s1 - s0]
        comm.Barrier()
        wall = time.perf_counter() - t0
        every = comm.gather(dict(_PH), root=0)
        if comm.rank == 0:
            reps.append({"wall_s": wall, "load_avg": os.getloadavg()[0], "phases": {
                k: {"wall_s_slowest_rank": max(p[k][0] for p in every if k in p),
                    "cpu_s_all_ranks": sum(p[k][1] for p in every if k in p),
                    "sys_s_all_ranks": sum(p[k][2] for p in every if k in p)} for k in every[0]}})
    if comm.rank == 0:
        Path(a.out).write_text(json.dumps({"reps": reps, "bytes": bc.dir_bytes(os.path.join(a.dir, "phases")),
                                           "zerompi": zerompi.__file__}))


# ---------------------------------------------------------------------------- ceilings
def _dd(files: list[str], direct: bool) -> float:
    """GB/s of reading `files` cold, one dd per file at once (4 MiB requests)."""
    bc.drop_caches()
    t0 = time.perf_counter()
    procs = [subprocess.Popen(["dd", f"if={f}", "of=/dev/null", "bs=4M"] + (["iflag=direct"] if direct else []),
                              stderr=subprocess.DEVNULL) for f in files]
    for p in procs:
        p.wait()
    return sum(map(os.path.getsize, files)) / (time.perf_counter() - t0) / 1e9


def ceilings(one: list[str], four: list[str], repeats: int) -> dict:
    out = {}
    cases = [(f"dd_{'direct' if d else 'buffered'}_{len(fs)}_reader{'s' * (len(fs) > 1)}_gbs", fs, d)
             for d in (True, False) for fs in (one, four)]
    for _ in range(repeats):
        for key, files, direct in cases:
            out.setdefault(key, []).append(round(_dd(files, direct), 3))
    buf = bytearray(os.urandom(1 << 20) * 256)
    t0 = time.process_time()
    zlib.crc32(buf)
    out["crc32_gbs_one_core"] = [round(len(buf) / (time.process_time() - t0) / 1e9, 3)]
    with open(one[0], "rb", buffering=0) as f:
        f.readinto(buf)  # into the page cache first
        f.seek(0)
        t0 = time.perf_counter()
        k = f.readinto(buf)
        out["page_cache_copy_gbs_one_core"] = [round(k / (time.perf_counter() - t0) / 1e9, 3)]
    return out


# ---------------------------------------------------------------------------- driver
def _summary(reps: list[dict], nbytes: int) -> dict:
    walls = sorted(r["wall_s"] for r in reps)
    med = statistics.median(walls)
    phases = {k: {m: round(statistics.median(r["phases"][k][m] for r in reps if k in r["phases"]), 4)
                  for m in reps[0]["phases"][k]} for k in reps[0]["phases"]}
    return {"best_s": round(walls[0], 4), "median_s": round(med, 4), "best_gbs": round(nbytes / walls[0] / 1e9, 3),
            "median_gbs": round(nbytes / med / 1e9, 3), "phases_median": phases}


def driver(a) -> None:
    os.makedirs(a.workdir, exist_ok=True)
    sides = {"after": str(ROOT)}
    if a.before:
        sides["before"] = os.path.abspath(a.before)
    pairs = [(side, n) for n in (1, 4) for side in sides]
    jobs, runs = [], {(side, n): [] for side, n in pairs}
    for r in range(a.rounds):
        for side, n in (pairs if r % 2 == 0 else pairs[::-1]):  # ABBA: drift cancels
            out = Path(a.workdir) / f"phases-{side}-n{n}-r{r}.json"
            argv = [Path(__file__).resolve(), "--model", a.model, "--vocab", a.vocab, "--repeats", a.repeats,
                    "--root", sides[side], "--dir", Path(a.workdir) / f"ck-n{n}", "--out", out,
                    "--settle", a.settle]
            load0 = os.getloadavg()
            job = launch(n, argv, timeout=a.timeout, root=sides[side], env={"DS_ACCELERATOR": "cpu"})
            if not job.ok:
                raise SystemExit(f"{side} N={n} failed ({job.status}):\n{job.tail(2000)}")
            res = json.loads(out.read_text())
            if not res["zerompi"].startswith(sides[side] + os.sep):
                raise SystemExit(f"{side} imported {res['zerompi']}, not from {sides[side]}")
            runs[side, n] += res["reps"]
            jobs.append({"side": side, "n": n, "round": r, "bytes": res["bytes"],
                         "load_avg_before": [round(x, 2) for x in load0],
                         "load_avg_after": [round(x, 2) for x in os.getloadavg()],
                         "wall_s": [round(x["wall_s"], 4) for x in res["reps"]],
                         "phases": [{k: round(v["wall_s_slowest_rank"], 4) for k, v in x["phases"].items()}
                                    for x in res["reps"]]})
            print(json.dumps({k: v for k, v in jobs[-1].items() if k != "phases"}), flush=True)
    nbytes = jobs[-1]["bytes"]
    one = glob.glob(str(Path(a.workdir) / "ck-n1" / "phases" / "rank-*.h5"))
    four = sorted(glob.glob(str(Path(a.workdir) / "ck-n4" / "phases" / "rank-*.h5")))
    report = {"benchmark": "verified checkpoint load, per phase", "model": f"{a.model} (vocab {a.vocab})",
              "state_bytes": nbytes, "repeats_per_job": a.repeats, "rounds": a.rounds, "settle_s": a.settle,
              "machine": dict(bc.machine_info(a.workdir), name=a.machine or None),
              "date": time.strftime("%Y-%m-%d %H:%M:%S"), "sides": sides, "jobs": jobs,
              "ceilings": ceilings(one, four, a.repeats)}
    for side in sides:  # "n1"/"n4" for this checkout; "before_n1"/"before_n4" with --before
        pre = "" if side == "after" else f"{side}_"
        report[f"{pre}n1"], report[f"{pre}n4"] = (_summary(runs[side, n], nbytes) for n in (1, 4))
        report[f"{pre}load_gbs_n4_over_n1"] = {k: round(report[f"{pre}n4"][f"{k}_gbs"] /
                                                        report[f"{pre}n1"][f"{k}_gbs"], 3) for k in ("best", "median")}
    for n in (1, 4):
        subprocess.run(["rm", "-rf", str(Path(a.workdir) / f"ck-n{n}")])
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(report, indent=1))
    print(f"wrote {a.out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--driver", action="store_true")
    ap.add_argument("--model", default="gpt2")
    ap.add_argument("--vocab", type=int, default=64000)
    ap.add_argument("--machine", default="")
    ap.add_argument("--rounds", type=int, default=2, help="N=1/N=4 pairs of jobs, in ABBA order")
    ap.add_argument("--repeats", type=int, default=5, help="cold loads per job")
    ap.add_argument("--settle", type=float, default=0.0,
                    help="seconds between dropping the page cache and each load (5: the VM has "
                         "handed the freed memory back to the host, as before a fresh job's load)")
    ap.add_argument("--before", default="", help="another zerompi checkout: its jobs alternate with this one's")
    ap.add_argument("--root", default=str(ROOT), help=argparse.SUPPRESS)
    ap.add_argument("--dir", default="/tmp/zerompi-ckphases/ck")
    ap.add_argument("--workdir", default="/tmp/zerompi-ckphases")
    ap.add_argument("--timeout", type=int, default=1200)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    driver(a) if a.driver else worker(a)


if __name__ == "__main__":
    main()
