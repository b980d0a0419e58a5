#!/usr/bin/env python
"""Checkpoint save/load throughput: zerompi (HDF5 shards) vs torch.save vs DeepSpeed.

The driver runs systems x N = 1, 2, 4, one job of this file's --worker mode each, and writes
the merged JSON and its PNG:

    python benchmarks/bench_checkpoint.py --machine vm-epyc --out benchmarks/results/checkpoint_vm-epyc_202611.json
    python benchmarks/bench_checkpoint.py --replot benchmarks/results/checkpoint_vm-epyc_202611.json

Every system holds the same state: the GPT preset in fp32 plus AdamW moments after one
training step (so moments are not zeros). zerompi runs ZeRO stage 2 and writes one
file per rank + index.h5 + manifest, fsynced, checksums (CRC-32 per 64 MiB block)
computed from memory while saving (state written with O_DIRECT where the filesystem
allows it) and verified on load. Each job records the load average before and after it. torch: one process, torch.save({"model", "optimizer"}) then fsync; torch.load
(weights_only=True) + load_state_dict. DeepSpeed (when importable; --ds-python names an
interpreter that has it): ZeRO stage 2 on CPU with gloo, engine.save_checkpoint then
os.sync() (DeepSpeed does not fsync), engine.load_checkpoint. Loads are timed after
dropping the page cache when /proc/sys/vm/drop_caches is writable ("cold") and not --warm.
Throughput = checkpoint bytes / wall seconds; per rank = the rank's own bytes / seconds.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from harness import launch, machine_info, pyplot, result_path, save_figure, write_json


WARM = False  # --warm: the page cache is left alone (a smoke run on a shared machine)


def drop_caches() -> bool:
    if WARM:
        return False
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def dir_bytes(path: str) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def model_config(name: str, vocab: int = 0):
    """A GPT preset, optionally with another vocabulary (gpt2 + vocab 64000 = 135.0M)."""
    import dataclasses

    from zerompi.models.gpt import PRESETS

    return dataclasses.replace(PRESETS[name], vocab_size=vocab) if vocab else PRESETS[name]


def build_model(name: str, vocab: int = 0):
    import torch

    from zerompi.models.gpt import GPT

    torch.manual_seed(0)
    return GPT(model_config(name, vocab))


def one_step(model_call, backward, step, vocab: int) -> None:
    import torch

    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, vocab, (1, 32), generator=g)
    _, loss = model_call(x, torch.roll(x, -1, 1))
    backward(loss)
    step()


# ---------------------------------------------------------------------------- systems
def bench_zerompi(a, comm) -> dict:
    import zerompi
    from zerompi.checkpoint import load, save

    model = build_model(a.model, a.vocab)
    engine = zerompi.initialize(model, {"stage": 2, "precision": "fp32", "optimizer": {"lr": 1e-4}})
    one_step(engine, engine.backward, engine.step, model.config.vocab_size)
    rank = comm.Get_rank()
    out = {"save_s": [], "load_s": [], "load_noverify_s": []}
    pair = comm.Get_size() == 1  # N=1: torch.save/load of the very same tensors, interleaved
    if pair:
        out.update(torch_save_s=[], torch_load_s=[])
    for rep in range(a.repeats):
        comm.Barrier()
        t0 = time.perf_counter()
        path = save(engine, a.dir, tag=f"rep{rep}", keep_last=1)
        comm.Barrier()
        out["save_s"].append(time.perf_counter() - t0)
        for key, verify in (("load_s", True), ("load_noverify_s", False)):
            cold = drop_caches() if rank == 0 else None
            comm.Barrier()
            t0 = time.perf_counter()
            load(engine, a.dir, verify=verify)
            comm.Barrier()
            out[key].append(time.perf_counter() - t0)
            out["cold"] = comm.bcast(cold)
        # torch's pair after zerompi's loads, so that at every N a load follows its own save:
        # drop_caches right after a torch.save frees 1.6 GB of page cache just before the load,
        # and on a VM that returns freed memory to the host, refilling just-freed pages costs
        # far less (N = 1, medians of 10 loads: 1.01 s after torch's save, 1.27 s without)
        if pair:
            out["torch_save_s"].append(_torch_same_tensors(engine, a.dir, "save"))
            drop_caches()
            out["torch_load_s"].append(_torch_same_tensors(engine, a.dir, "load"))
    out["rank_bytes"] = comm.allgather(os.path.getsize(os.path.join(path, f"rank-{rank:05d}.h5")))
    out["total_bytes"] = dir_bytes(path)
    return out


def _torch_same_tensors(engine, directory: str, what: str) -> float:
    """Seconds for torch.save (+ fsync) of the engine's own state tensors (master and
    moments, the views the checkpoint writes), or torch.load + copy back into them:
    the like-for-like reference, timed right beside zerompi's own save or
    load so that both see the same machine load."""
    import torch

    st = engine.export_state(views=True)
    views = {f"{k}/{i}": t for k, ts in st["tensors"].items() for i, t in enumerate(ts)}
    path = os.path.join(directory, "same_tensors.pt")
    t0 = time.perf_counter()
    if what == "save":
        # clone-free: torch.save writes each view's storage (the flat buffers) once
        torch.save(views, path)
        with open(path, "rb+") as f:
            os.fsync(f.fileno())
    else:
        sd = torch.load(path, weights_only=True)
        for k, t in views.items():
            t.copy_(sd[k])
        del sd
    return time.perf_counter() - t0


def bench_torch(a) -> dict:
    import torch

    model = build_model(a.model, a.vocab)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    one_step(model, lambda loss: loss.backward(), opt.step, model.config.vocab_size)
    os.makedirs(a.dir, exist_ok=True)
    path = os.path.join(a.dir, "torch_ckpt.pt")
    out = {"save_s": [], "load_s": []}
    for _ in range(a.repeats):
        t0 = time.perf_counter()
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
        with open(path, "rb+") as f:
            os.fsync(f.fileno())
        out["save_s"].append(time.perf_counter() - t0)
        out["cold"] = drop_caches()
        t0 = time.perf_counter()
        sd = torch.load(path, weights_only=True)
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optimizer"])
        del sd
        out["load_s"].append(time.perf_counter() - t0)
    out["rank_bytes"] = [os.path.getsize(path)]
    out["total_bytes"] = out["rank_bytes"][0]
    return out


def bench_deepspeed(a, comm) -> dict:
    import deepspeed
    import torch

    rank, n = comm.Get_rank(), comm.Get_size()
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(n), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(n), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(comm.bcast(a.port))})
    deepspeed.init_distributed(dist_backend="gloo")
    model = build_model(a.model, a.vocab)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2},
           "zero_allow_untested_optimizer": True}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    one_step(engine, engine.backward, engine.step, model.config.vocab_size)
    out = {"save_s": [], "load_s": [], "version": deepspeed.__version__}
    for rep in range(a.repeats):
        torch.distributed.barrier()
        t0 = time.perf_counter()
        engine.save_checkpoint(a.dir, tag=f"rep{rep}")
        os.sync()
        torch.distributed.barrier()
        out["save_s"].append(time.perf_counter() - t0)
        cold = drop_caches() if rank == 0 else None
        torch.distributed.barrier()
        t0 = time.perf_counter()
        engine.load_checkpoint(a.dir, tag=f"rep{rep}")
        torch.distributed.barrier()
        out["load_s"].append(time.perf_counter() - t0)
        out["cold"] = comm.bcast(cold)
    tagdir = os.path.join(a.dir, f"rep{a.repeats - 1}")
    out["total_bytes"] = dir_bytes(tagdir)
    out["rank_bytes"] = [out["total_bytes"] // n] * n  # DeepSpeed's files are not per-rank only
    return out


# ---------------------------------------------------------------------------- driver
def summarize(r: dict, n: int) -> dict:
    best = lambda k: min(r[k]) if r.get(k) else None  # noqa: E731
    s = {"n": n, "total_bytes": r["total_bytes"], "save_s": best("save_s"), "load_s": best("load_s"),
         "load_noverify_s": best("load_noverify_s"), "cold_load": r.get("cold"),
         "all_s": {k: r[k] for k in ("save_s", "load_s", "load_noverify_s", "torch_save_s", "torch_load_s")
                   if r.get(k)}}
    if r.get("torch_save_s"):
        # Per repeat, zerompi over torch.save/load of the same tensors timed just after it.
        ratio = lambda a, b: sorted(x / y for x, y in zip(r[a], r[b]))  # noqa: E731
        s["same_tensor_ratios"] = {"save": ratio("save_s", "torch_save_s"), "load": ratio("load_s", "torch_load_s")}
        s["torch_same_tensors_save_s"], s["torch_same_tensors_load_s"] = best("torch_save_s"), best("torch_load_s")
    for k in ("save", "load", "load_noverify"):
        t = s[f"{k}_s"]
        if t:
            s[f"{k}_gbs"] = r["total_bytes"] / t / 1e9
            s[f"{k}_gbs_per_rank"] = sum(r["rank_bytes"]) / n / t / 1e9
    return s


def run_job(system: str, n: int, a, python: str) -> dict:
    out = Path(a.workdir) / f"{system}-n{n}.json"
    ckdir = Path(a.workdir) / f"ck-{system}-n{n}"
    shutil.rmtree(ckdir, ignore_errors=True)
    argv = [Path(__file__).resolve(), "--worker", "--system", system, "--model", a.model, "--vocab", a.vocab,
            "--dir", ckdir, "--out", out, "--repeats", a.repeats, "--port", 29500 + n] + ["--warm"] * a.warm
    load0 = os.getloadavg()
    # torch's job is one process without mpiexec
    job = launch(None if system == "torch" else n, argv, timeout=a.timeout, python=python,
                 env={"DS_ACCELERATOR": "cpu"})
    load = {"load_avg_before": [round(x, 2) for x in load0], "load_avg_after": [round(x, 2) for x in os.getloadavg()]}
    shutil.rmtree(ckdir, ignore_errors=True)
    if not job.ok:
        return {"system": system, "n": n, "error": job.tail(2000), **load}
    res = json.loads(out.read_text())
    return dict(summarize(res, n), system=system, job_seconds=round(job.elapsed_s, 1), **load,
                **({"version": res["version"]} if "version" in res else {}))


def driver(a) -> None:
    import torch

    from zerompi.models.gpt import count_params

    os.makedirs(a.workdir, exist_ok=True)
    results, notes = [], []
    for n in a.ranks:
        results.append(run_job("zerompi", n, a, sys.executable))
        print(json.dumps(results[-1]), flush=True)
    results.append(run_job("torch", 1, a, sys.executable))
    print(json.dumps(results[-1]), flush=True)
    ds_python = a.ds_python or sys.executable
    probe = subprocess.run([ds_python, "-c", "import deepspeed"], capture_output=True, text=True,
                           env=dict(os.environ, DS_ACCELERATOR="cpu"))
    if probe.returncode == 0:
        for n in a.ranks:
            results.append(run_job("deepspeed", n, a, ds_python))
            print(json.dumps(results[-1]), flush=True)
    else:
        notes.append(f"DeepSpeed skipped: not importable with {ds_python} ({probe.stderr.strip()[-200:]})")
    report = {"benchmark": "checkpoint save/load", "model": a.model + (f" (vocab {a.vocab})" if a.vocab else ""),
              "params": count_params(model_config(a.model, a.vocab)), "precision": "fp32", "zerompi_stage": 2,
              "repeats": a.repeats, "timing": "best of repeats, wall clock between barriers",
              "machine": {**machine_info(a.workdir), "load_avg_at_start": os.getloadavg()}, "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d %H:%M:%S"), "results": results, "notes": notes,
              "checks": checks(results)}
    if a.machine:
        report["machine"]["name"] = a.machine
    write_json(a.out, report)
    plot(report, Path(a.out).with_suffix(".png"))
    print(f"wrote {a.out} and its PNG")


def checks(results: list[dict]) -> dict:
    """Issue 16's targets: zerompi at N=1 within 1.5x of torch.save/torch.load, and more
    bytes per second at N=4 than at N=1."""
    get = lambda system, n: next((r for r in results if r["system"] == system and r["n"] == n  # noqa: E731
                                  and "error" not in r), None)
    z1, z4, t1 = get("zerompi", 1), get("zerompi", 4), get("torch", 1)
    out = {}
    if z1 and t1:  # best of each, timed in separate jobs (minutes apart on a shared VM)
        out["save_ratio_n1_vs_torch_job"] = z1["save_s"] / t1["save_s"]
        out["load_ratio_n1_vs_torch_job"] = z1["load_s"] / t1["load_s"]
    if z1 and z1.get("same_tensor_ratios"):  # interleaved with zerompi in one process: the fair one
        med = lambda v: v[len(v) // 2]  # noqa: E731
        out["save_ratio_n1_same_tensors_median"] = med(z1["same_tensor_ratios"]["save"])
        out["load_ratio_n1_same_tensors_median"] = med(z1["same_tensor_ratios"]["load"])
        out["within_1.5x_of_torch"] = max(out["save_ratio_n1_same_tensors_median"],
                                          out["load_ratio_n1_same_tensors_median"]) <= 1.5
    if z1 and z4:
        out["save_gbs_n4_over_n1"] = z4["save_gbs"] / z1["save_gbs"]
        out["load_gbs_n4_over_n1"] = z4["load_gbs"] / z1["load_gbs"]
    return out


def plot(report: dict, png: str) -> None:
    plt = pyplot()
    rows = [r for r in report["results"] if "error" not in r]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=False)
    for ax, key, title in ((axes[0], "save", "save"), (axes[1], "load", "load, cold page cache (zerompi: incl. checksum verify)")):
        labels, agg, per = [], [], []
        for r in rows:
            if r.get(f"{key}_gbs") is None:
                continue
            labels.append(f"{r['system']}\nN={r['n']}")
            agg.append(r[f"{key}_gbs"])
            per.append(r[f"{key}_gbs_per_rank"])
        x = range(len(labels))
        ax.bar([i - 0.2 for i in x], agg, 0.4, label="aggregate")
        ax.bar([i + 0.2 for i in x], per, 0.4, label="per rank")
        ax.set_xticks(list(x), labels, fontsize=8)
        ax.set_ylabel("GB/s")
        ax.set_title(title)
        ax.legend(fontsize=8)
    m = report["machine"]
    ram = m.get("ram_gib") or round((m.get("ram_bytes") or 0) / 2**30, 1)
    save_figure(fig, png, f"{report['model']} ({report['params'] / 1e6:.0f}M params, fp32 + AdamW) checkpoint "
                f"throughput — {m.get('name', m.get('node', m.get('hostname')))}: {m['cores']} cores "
                f"{m.get('cpu_model', m.get('cpu'))}, {ram} GiB, {m['disk']}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", action="store_true", help="one job's ranks (the driver starts them)")
    ap.add_argument("--system", choices=("zerompi", "torch", "deepspeed"), default="zerompi")
    ap.add_argument("--model", default="gpt2", help="GPT preset (gpt2, gpt-200m, gpt-20m, small, tiny)")
    ap.add_argument("--vocab", type=int, default=64000,
                    help="vocabulary size override (0 = the preset's); gpt2 + 64000 = 135.0M parameters")
    ap.add_argument("--machine", default="", help='a name for the machine in the report, e.g. "vm"')
    ap.add_argument("--ranks", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dir", default="/tmp/zerompi-ckbench/ck")
    ap.add_argument("--workdir", default="/tmp/zerompi-ckbench")
    ap.add_argument("--ds-python", default="", help="python that can import deepspeed (default: this one)")
    ap.add_argument("--port", type=int, default=29500)
    ap.add_argument("--timeout", type=int, default=1800)
    ap.add_argument("--warm", action="store_true", help="never drop the page cache (loads read it warm)")
    ap.add_argument("--out")
    ap.add_argument("--replot", metavar="JSON", help="redraw the PNG of a report (next to it)")
    a = ap.parse_args(argv)
    global WARM
    WARM = a.warm
    if a.replot:
        plot(json.loads(Path(a.replot).read_text()), Path(a.replot).with_suffix(".png"))
        return
    if not a.worker:
        a.out = a.out or str(result_path("checkpoint"))
        driver(a)
        return
    if a.system == "torch":
        res = bench_torch(a)
    else:
        from mpi4py import MPI

        res = bench_zerompi(a, MPI.COMM_WORLD) if a.system == "zerompi" else bench_deepspeed(a, MPI.COMM_WORLD)
        if MPI.COMM_WORLD.Get_rank() != 0:
            return
    Path(a.out).write_text(json.dumps(res))


if __name__ == "__main__":
    main()
