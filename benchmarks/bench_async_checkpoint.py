#!/usr/bin/env python
"""Asynchronous vs synchronous checkpoints while training: stall per save and step time.

The driver runs N = 2, 4 x stages 1-3, one job of this file's --worker mode each (it
interleaves every kind of save), and writes the merged JSON and its PNG:

    python benchmarks/bench_async_checkpoint.py --machine vm-epyc --out benchmarks/results/checkpoint_async_vm-epyc_202611.json
    python benchmarks/bench_async_checkpoint.py --replot benchmarks/results/checkpoint_async_vm-epyc_202611.json

The 135.0M-parameter GPT of bench_checkpoint.py (gpt2 shape, vocabulary 64000) in fp32
with AdamW trains steps of one 128-token sequence per rank. Saves follow one another in
the order sync, thread, process, process, thread, sync (ABBA, so a drift of the machine's
load hits every kind alike), each after `--gap` steps without a save:
  sync     zerompi.checkpoint.save: the stall is its wall time (barriers around it);
  thread   async_save with the background write in a low-priority thread of the rank;
  process  async_save with the write in the rank's helper process.
An asynchronous save's stall is the time the loop was blocked by it (the save call, the
poll of each step, the publication, a wait for the snapshot copy before an update: the
"stall_s" the saver reports), the slowest rank's; its steps are those that ran while it
was in flight (poll included). Normal steps: steps with no save in flight, not the
first after a save (a rotated checkpoint is being deleted then). Every rank's CPU time
and the helper process's are read around each save, for what the writer costs.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import time
from pathlib import Path

from bench_checkpoint import build_model
from harness import git_info, launch, machine_info, pyplot, result_path, save_figure, write_json

ORDER = ("sync", "thread", "process", "process", "thread", "sync")


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _proc_cpu(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def _helper(saver) -> int | None:
    """pid of a saver's helper process (writer "process"), else None."""
    proc = getattr(getattr(saver, "writer", None), "proc", None)
    return proc.pid if proc is not None else None


def worker(a) -> None:
    import torch
    from mpi4py import MPI

    import zerompi
    from zerompi.checkpoint import poll, save
    from zerompi.checkpoint.background.saver import AsyncSaver

    comm = MPI.COMM_WORLD
    rank, n = comm.Get_rank(), comm.Get_size()
    torch.set_num_threads(1)
    model = build_model(a.model, a.vocab)
    engine = zerompi.initialize(model, {"stage": a.stage, "precision": "fp32", "optimizer": {"lr": 1e-4}})
    vocab = model.config.vocab_size
    kinds = sorted({k for k in a.order if k != "sync"})
    # "process@19": the process writer at nice 19 (default: background.WRITER_NICE)
    savers = {k: AsyncSaver(engine.checkpoint_view(), k.split("@")[0], *([int(k.split("@")[1])] if "@" in k else [])) for k in kinds}
    for s in savers.values():
        s.prepare()   # as python -m zerompi.train does before its first step
    timeline, events = [], []
    count = [0]

    def step(state: str):
        g = torch.Generator().manual_seed(1000 * rank + count[0])
        count[0] += 1
        t0 = time.perf_counter()
        x = torch.randint(0, vocab, (1, a.tokens), generator=g)
        _, loss = engine(x, torch.roll(x, -1, 1))
        engine.backward(loss)
        engine.step()
        rec = poll(engine)
        timeline.append({"s": time.perf_counter() - t0, "state": state})
        return rec

    for _ in range(2):   # warm-up (first steps allocate)
        step("warmup")
    for i, kind in enumerate(a.order * a.rounds):
        for _ in range(a.gap):
            step("idle")
        comm.Barrier()
        cpu0, t0 = _cpu(), time.perf_counter()
        helper = _helper(savers.get(kind))
        hcpu0 = _proc_cpu(helper) if helper else 0.0
        tag = f"e{i:02d}-{kind}"
        if kind == "sync":
            save(engine, a.dir, tag=tag, keep_last=2)
            comm.Barrier()
            ev = {"kind": kind, "stall_s": time.perf_counter() - t0, "write_s": time.perf_counter() - t0,
                  "steps": 0}
        else:
            engine.checkpoint_view().saver = savers[kind]
            save(engine, a.dir, tag=tag, keep_last=2, async_save=True, writer=kind.split("@")[0])
            begin = time.perf_counter() - t0
            k, rec = 0, None
            while rec is None:
                rec = step(kind)
                k += 1
            ev = {"kind": kind, "stall_s": rec["stall_s"], "write_s": rec["write_s"], "begin_s": begin,
                  "steps": k, "wall_s": time.perf_counter() - t0, "parts": rec["parts"]}
        ev["rank_cpu_s"] = _cpu() - cpu0
        ev["helper_cpu_s"] = (_proc_cpu(helper) - hcpu0) if helper else 0.0
        ev["at_step"] = len(timeline)
        events.append(ev)
        step("after")   # the first step after a save: a rotated checkpoint is being deleted
    for _ in range(a.gap):
        step("idle")
    idle = [t["s"] for t in timeline if t["state"] == "idle"]
    every = comm.gather({"rank": rank, "timeline": timeline, "events": events, "idle_median_s": statistics.median(idle)})
    for sv in savers.values():
        sv.close()
    if rank == 0:
        with open(a.out, "w") as f:
            json.dump({"n": n, "stage": a.stage, "tokens": a.tokens, "order": a.order * a.rounds, "ranks": every}, f)


def summarize(job: dict) -> dict:
    """Per kind of save: stall (the slowest rank's, per save), write time, steps in flight;
    step times during a background write over the normal ones around it."""
    ranks = job["ranks"]
    out = {"n": job["n"], "stage": job["stage"]}
    nev = len(ranks[0]["events"])
    kinds = list(dict.fromkeys(job["order"]))
    per = {k: {"stall_s": [], "write_s": [], "steps": [], "step_ratio": [], "first_step_ratio": [], "lost_s": [],
               "cpu_s": []} for k in kinds}
    for i in range(nev):
        evs = [r["events"][i] for r in ranks]
        kind = evs[0]["kind"]
        d = per[kind]
        d["stall_s"].append(max(e["stall_s"] for e in evs))
        d["write_s"].append(max(e["write_s"] for e in evs))
        d["cpu_s"].append(sum(e["rank_cpu_s"] + e["helper_cpu_s"] for e in evs))
        if kind == "sync":
            d["lost_s"].append(d["stall_s"][-1])
            continue
        d["steps"].append(evs[0]["steps"])
        ratios = []
        for r, e in zip(ranks, evs):
            tl = r["timeline"]
            start = e["at_step"] - e["steps"]
            during = [t["s"] for t in tl[start:e["at_step"]]]
            # the normal steps nearest this save, brackets in time against the machine's
            # drifting load: the gap right before it and the one right after
            near = [t["s"] for t in tl[max(0, start - 8):start] if t["state"] == "idle"][-4:] + \
                   [t["s"] for t in tl[e["at_step"]:e["at_step"] + 8] if t["state"] == "idle"][:4]
            base = statistics.median(near)
            ratios.append((statistics.mean(during) / base, during[0] / base, sum(during) - base * len(during)))
        d["step_ratio"].append(max(r[0] for r in ratios))
        d["first_step_ratio"].append(max(r[1] for r in ratios))   # the step that also copies the snapshot
        # training time the save cost: its stall plus what the steps in flight took beyond usual
        d["lost_s"].append(d["stall_s"][-1] + max(r[2] for r in ratios))
    for k, d in per.items():
        out[k] = {key: [round(v, 4) for v in vals] for key, vals in d.items() if vals}
        out[k].update({f"{key}_median": round(statistics.median(vals), 4) for key, vals in d.items() if vals})
    sync = out["sync"]["stall_s_median"]
    for k in (k for k in kinds if k != "sync"):
        out[k]["stall_over_sync"] = round(out[k]["stall_s_median"] / sync, 4)
        out[k]["stall_over_sync_max"] = round(max(out[k]["stall_s"]) / sync, 4)
    return out


def driver(a) -> None:
    work = Path(a.workdir)
    work.mkdir(parents=True, exist_ok=True)
    info = {**machine_info(str(work)), **git_info()}
    info["name"] = a.machine or info["node"]
    report = {"benchmark": "asynchronous vs synchronous checkpoints while training",
              "model": f"{a.model} (vocab {a.vocab}), fp32 + AdamW", "tokens_per_rank_step": a.tokens,
              "order": a.order * a.rounds, "machine": info, "note": a.note,
              "date": time.strftime("%Y-%m-%d %H:%M:%S"), "jobs": [], "summary": []}
    for n in a.ranks:
        for stage in a.stages:
            out = work / f"n{n}-s{stage}.json"
            argv = [__file__, "--worker", "--stage", str(stage), "--dir", str(work / "ck"), "--out", str(out),
                    "--rounds", str(a.rounds), "--gap", str(a.gap), "--tokens", str(a.tokens), "--order", ",".join(a.order),
                    "--model", a.model, "--vocab", str(a.vocab)]
            before, t0 = os.getloadavg(), time.perf_counter()
            shutil.rmtree(work / "ck", ignore_errors=True)
            p = launch(n, argv, timeout=a.timeout)   # the ranks' environment and kill policy of every benchmark
            if not p.ok:
                raise SystemExit(f"job n={n} stage={stage} failed ({p.status}):\n{p.tail()}")
            job = json.loads(out.read_text())
            job.update(load_avg_before=before, load_avg_after=os.getloadavg(),
                       job_seconds=round(time.perf_counter() - t0, 1))
            report["jobs"].append(job)
            s = summarize(job)
            s.update(load_avg_before=[round(x, 2) for x in before],
                     load_avg_after=[round(x, 2) for x in os.getloadavg()])
            report["summary"].append(s)
            print(json.dumps({k: v for k, v in s.items() if not isinstance(v, dict)}),
                  {k: {kk: vv for kk, vv in v.items() if kk.endswith(("median", "sync", "_max"))}
                   for k, v in s.items() if isinstance(v, dict)}, flush=True)
            write_json(a.out, report)   # after every job: a long run keeps what it measured
    plot(report, Path(a.out).with_suffix(".png"))


def resummarize(path: str) -> None:
    """Recompute a report's summaries from its jobs (after a change to summarize)."""
    report = json.loads(Path(path).read_text())
    for job, s in zip(report["jobs"], report["summary"]):
        s.update(summarize(job))
    Path(path).write_text(json.dumps(report, indent=1))


COLORS = {"sync": "#888888", "thread": "#1f77b4", "process": "#d62728"}


def plot(report: dict, png) -> None:
    """Per N x stage: each asynchronous writer's stall per save over the synchronous save's
    time (the 10% line), the step time during a background write over a normal step (the
    1.15x line), the training time each kind of save cost next to the synchronous one."""
    plt = pyplot()
    rows = report["summary"]
    labels = [f"N={s['n']}\nstage {s['stage']}" for s in rows]
    kinds = [k for k in ("thread", "process") if all(k in s for s in rows)]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    width = 0.8 / max(1, len(kinds))
    for ax, key, line, title in ((axes[0], "stall_over_sync", 0.10, "stall per save / sync save time (median)"),
                                 (axes[1], "step_ratio_median", 1.15, "step time during a background write\n"
                                                                       "/ normal step (median over saves)")):
        for j, k in enumerate(kinds):
            xs = [i + (j - (len(kinds) - 1) / 2) * width for i in range(len(rows))]
            ax.bar(xs, [s[k][key] for s in rows], width, label=k, color=COLORS[k])
        ax.axhline(line, color="k", ls="--", lw=1, label=f"target {line:g}")
        ax.set_xticks(range(len(rows)), labels)
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)
    ax = axes[2]
    all_kinds = ["sync"] + kinds
    width = 0.8 / len(all_kinds)
    for j, k in enumerate(all_kinds):
        xs = [i + (j - (len(all_kinds) - 1) / 2) * width for i in range(len(rows))]
        ax.bar(xs, [s[k]["lost_s_median"] for s in rows], width, label=k, color=COLORS[k])
    ax.set_xticks(range(len(rows)), labels)
    ax.set_ylabel("s")
    ax.set_title("training time lost per save (median)", fontsize=10)
    ax.legend(fontsize=8)
    m = report["machine"]
    save_figure(fig, png, f"{report['model']}, {report['tokens_per_rank_step']} tokens/rank/step; machine "
                f"{m['name']} ({m['cores']} cores, {m.get('cpu_model', m.get('cpu'))}), {report['date']}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", action="store_true", help="one job's ranks (the driver starts them)")
    ap.add_argument("--driver", action="store_true", help=argparse.SUPPRESS)  # the default; older commands name it
    ap.add_argument("--machine", default="")
    ap.add_argument("--note", default="", help="said in the report (e.g. what else ran on the machine)")
    ap.add_argument("--ranks", type=lambda s: [int(x) for x in s.split(",")], default=[2, 4])
    ap.add_argument("--stages", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 3])
    ap.add_argument("--stage", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1, help="times through the ABBA order of saves")
    ap.add_argument("--order", type=lambda s: s.split(","), default=list(ORDER),
                    help="saves in order: sync, thread, process, or WRITER@NICE (e.g. process@19)")
    ap.add_argument("--gap", type=int, default=3, help="normal steps before each save")
    ap.add_argument("--tokens", type=int, default=128, help="tokens per rank per step")
    ap.add_argument("--dir", default="/tmp/zerompi-asyncbench/ck")
    ap.add_argument("--workdir", default="/tmp/zerompi-asyncbench")
    ap.add_argument("--timeout", type=int, default=3600)
    ap.add_argument("--out")
    ap.add_argument("--resummarize", action="store_true", help="recompute the summaries of --out")
    ap.add_argument("--replot", metavar="JSON", help="redraw the PNG of a report (next to it)")
    ap.add_argument("--model", default="gpt2", help="a zerompi.models.gpt preset")
    ap.add_argument("--vocab", type=int, default=64000, help="its vocabulary (0: the preset's)")
    a = ap.parse_args(argv)
    if a.replot:
        plot(json.loads(Path(a.replot).read_text()), Path(a.replot).with_suffix(".png"))
    else:
        a.out = a.out or str(result_path("checkpoint_async"))
        resummarize(a.out) if a.resummarize else worker(a) if a.worker else driver(a)


if __name__ == "__main__":
    main()
