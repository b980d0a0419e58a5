"""A CPU proxy for the host overhead of a GPU training step: skeleton GPTs with
the real presets' structure at tiny widths (host_proxy_skeleton.py: the engine lays them out
into the same parameters, pieces, blocks and units as the real model), so compute is
negligible and what is left is the host's work: per step, zerompi stages 0-3 against plain
torch (fp32 parameters, bf16 autocast, clip_grad_norm_(foreach=True), AdamW(fused=True)).

    python benchmarks/bench_host_proxy.py --models gpt2,gpt-1b --stages 0,1,2,3 --world 1,2,4
    python benchmarks/bench_host_proxy.py --replot benchmarks/results/host_proxy_vm-xeon_202611.json

Per run, after --warmup steps: CPU seconds a step (world 1, in this process), and over
--count-steps steps host_proxy_count.py's counts, collectives by kind
(engine.comm_stats() deltas), stage 3's agreement rounds and Python time by package
(step_profile.python_top). --world 2,4: the counts on N ranks (this file's --worker mode
under mpiexec, rank 0's). The engine is bench_gpu_e2e.py's (engine_config) with the
skeleton's bucket and alignment and the fused optimizer, the GPU's choice; stage 3 as under
the GPU machine's torch (no UntypedStorage._swap_data_ptr_) whatever this torch has.
Needs a working MPI even at world 1; without one it says so in one line (exit 2).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from unittest import mock
from collections import Counter
from pathlib import Path

import torch

from harness import HERE, git_info, machine_info, result_path, write_json  # first: this checkout's zerompi
import host_proxy_count as hc  # noqa: E402
import host_proxy_skeleton as hs  # noqa: E402


def mpi_problem() -> str | None:
    """Why MPI cannot start here (None when it can), from a child process: a broken MPI
    library can end the process that loads it."""
    code = "from mpi4py import MPI; MPI.COMM_WORLD.Get_size()"
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        return "starting MPI took over 60 s"
    if r.returncode == 0:
        return None
    lines = [ln for ln in (r.stderr or r.stdout).strip().splitlines() if ln.strip()]
    return lines[-1] if lines else f"exit code {r.returncode}"


def make_batch(gpt, micro: int) -> tuple:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, gpt.vocab_size, (micro, gpt.block_size + 1), generator=g)
    return x[:, :-1].contiguous(), x[:, 1:].contiguous()


def torch_run(sk):
    from zerompi.models.gpt import GPT

    torch.manual_seed(0)
    model = GPT(sk.gpt)
    for fused in ({"fused": True}, {"foreach": True}):  # foreach: a torch without the fused CPU kernel
        try:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, **fused)
            break
        except (RuntimeError, ValueError):
            pass
    rec, clip = hc.REC, {"foreach": True}

    def step(x, y):
        rec.set_phase("forward")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, loss = model(x, y)
        rec.set_phase("after_backward")
        loss.backward()
        rec.set_phase("step")
        try:  # foreach, as on a GPU; a torch without CPU foreach support refuses it
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, **clip)
        except RuntimeError:
            clip.pop("foreach", None)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        rec.set_phase("idle")
        return loss
    return step, None, {"optimizer": "AdamW(" + ", ".join(f"{k}=True" for k in fused) + ")", "clip": clip}


def engine_run(sk, stage: int, world: int):
    import zerompi
    from e2e_systems import engine_config
    from zerompi.models.gpt import GPT

    cfg = hs.merged(engine_config("auto", stage),
                    {**sk.zero_overrides(stage, world), "optimizer": {"implementation": "fused"}})
    torch.manual_seed(0)
    engine = zerompi.initialize(GPT(sk.gpt), cfg)
    got, want = hs.engine_signature(engine), sk.signatures[(stage, world)]
    if got != want:  # the proxy is only as good as this
        raise AssertionError(f"{sk.preset} stage {stage} N = {world}: the engine laid the skeleton out as "
                             f"{hs.sig_dict(got)}, the real model as {hs.sig_dict(want)}")
    rec = hc.REC

    def step(x, y):
        rec.set_phase("forward")
        _, loss = engine(x, y)
        rec.set_phase("after_backward")
        engine.backward(loss)
        rec.set_phase("step")
        engine.step()
        rec.set_phase("idle")
        return loss
    # on a GPU the engine reads the step's norm a step late (zero/step_coef.py) where it can:
    # the read the CPU branch makes here is then no sync there
    defers = cfg.get("precision") != "fp16" and getattr(engine.optimizer, "takes_device_coef", False)
    return step, engine, {"optimizer": type(engine.optimizer).__name__, "backend": type(engine.comm).__name__,
                          "layout": hs.sig_dict(got), "defers_on_gpu": bool(defers)}


def _snapshot(engine) -> Counter:
    c = Counter({op: int(v["calls"]) for op, v in engine.comm_stats().items()})
    c["<rounds>"] = getattr(getattr(engine.param_store, "agreement", None), "held", 0) or 0
    return c


def count(step, batch, engine, steps: int) -> dict:
    """The counts of `steps` steps (host_proxy_count), collectives by kind, stage 3's rounds."""
    before = _snapshot(engine) if engine is not None else Counter()
    with hc.counting():
        for _ in range(steps):
            step(*batch)
    out = hc.REC.summary(steps)
    total = _snapshot(engine) - before if engine is not None else Counter()
    rounds = total.pop("<rounds>", 0)
    out["collectives"] = sum(total.values()) / steps
    out["collectives_by_kind"] = {k: v / steps for k, v in sorted(total.items())}
    out["agreement_rounds"] = rounds / steps if engine is not None and hasattr(engine.param_store, "agreement") else None
    return out


def timed(step, batch, a) -> dict:
    """CPU seconds of a.steps steps, one at a time, and Python time by package."""
    from step_profile import python_top

    walls, cpus = [], []
    for _ in range(a.steps):  # one at a time: the median and minimum resist other work on the cores
        w0, c0 = time.perf_counter(), time.process_time()
        step(*batch)
        walls.append(time.perf_counter() - w0)
        cpus.append(time.process_time() - c0)
    out = {"wall_s": statistics.median(walls), "cpu_s": statistics.median(cpus), "cpu_min_s": min(cpus)}
    if a.profile_steps:
        top, by_pkg = python_top(step, batch, steps=a.profile_steps, top=12)
        out["python_by_package_us"], out["python_top"] = by_pkg, top
    return out


def run_all(a, world: int) -> dict:
    """{model: {run: record}} of this process (rank) at `world` ranks."""
    import zerompi
    from zerompi.zero.stage3 import gather_pool

    zerompi.runtime.init()
    out = {}
    # the GPU machine's torch 2.11 has no storage swaps: its stage-3 units resize their own storage
    with hc.instrumented(), mock.patch.object(gather_pool, "available", lambda: False):
        for preset in a.models:
            sk = hs.find(preset, worlds=tuple(sorted({1, 2, 4} | set(a.world) | {world})))
            batch = make_batch(sk.gpt, a.micro)
            res = {"skeleton": sk.describe()}
            runs = [("torch", None)] if world == 1 else []
            runs += [(f"stage{s}", s) for s in a.stages]
            for name, stage in runs:
                t0 = time.perf_counter()
                step, engine, info = torch_run(sk) if stage is None else engine_run(sk, stage, world)
                for _ in range(a.warmup):
                    step(*batch)
                # timings at N = 1 only: those of ranks sharing cores mean little
                rec = timed(step, batch, a) if world == 1 and not a.counts_only else {}
                rec.update(count(step, batch, engine, a.count_steps))
                rec.update(info, seconds=time.perf_counter() - t0, optimizer_stand_in=dict(hc.STAND_IN))
                res[name] = rec
                if world == 1 or engine is None or engine.rank == 0:
                    print(f"{preset} {name} N={world}: {rec.get('cpu_s', 0) * 1e3:.1f} CPU-ms/step, "
                          f"{rec['ops']:.0f} ops, "
                          f"{rec.get('collectives', 0):.0f} collectives, {rec['device_scalar_reads']:.0f} reads, "
                          f"{rec['polls_in_backward']:.0f} polls in backward", flush=True)
                del step, engine
            out[preset] = res
    return out


def worker(a) -> int:
    """Under mpiexec: every rank runs; rank 0 prints its counts as one JSON line."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    res = run_all(a, comm.Get_size())
    if comm.Get_rank() == 0:
        print("HOST_PROXY_JSON " + json.dumps(res), flush=True)
    return 0


def ranks(a, world: int) -> dict:
    from harness import launch

    argv = [HERE / "bench_host_proxy.py", "--worker", "--models", ",".join(a.models),
            "--stages", ",".join(map(str, a.stages)), "--world", ",".join(map(str, a.world)),
            "--warmup", "1", "--count-steps", str(a.count_steps), "--micro", str(a.micro)]
    job = launch(world, argv, timeout=a.rank_timeout)
    for line in job.output.splitlines():
        if line.startswith("HOST_PROXY_JSON "):
            return json.loads(line.split(" ", 1)[1])
    raise RuntimeError(f"the {world}-rank counts failed ({job.status}):\n{job.tail()}")


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="gpt2,gpt-1b", help="presets of zerompi/models/gpt_config.py")
    ap.add_argument("--stages", default="0,1,2,3")
    ap.add_argument("--world", default="1", help="world sizes; 1 in this process, others through mpiexec (counts)")
    ap.add_argument("--micro", type=int, default=2, help="sequences per micro-batch (the skeleton's context each)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5, help="timed steps")
    ap.add_argument("--count-steps", type=int, default=2, help="steps counted under the dispatch mode")
    ap.add_argument("--profile-steps", type=int, default=3, help="steps under cProfile (0: none)")
    ap.add_argument("--counts-only", action="store_true", help="no timed or profiled steps (tests)")
    ap.add_argument("--rank-timeout", type=float, default=300.0, help="seconds for each mpiexec job")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--replot", metavar="JSON", help="redraw the PNG beside a result JSON from the JSON alone")
    ap.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/host_proxy_<machine>_<yyyymm>.json)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    a.models = [m for m in a.models.split(",") if m]
    a.stages = [int(s) for s in a.stages.split(",") if s.strip() and s != "none"]
    a.world = sorted({int(w) for w in a.world.split(",")})
    from zerompi.models.gpt import PRESETS

    if [m for m in a.models if m not in PRESETS] or not a.models:
        ap.error(f"--models {','.join(a.models)}: presets of {sorted(PRESETS)}")
    if any(s not in (0, 1, 2, 3) for s in a.stages) or any(w < 1 for w in a.world):
        ap.error(f"--stages {a.stages} must be in 0-3 and --world {a.world} >= 1")
    return a


def main(argv=None) -> int:
    a = parse(argv)
    if a.replot:
        plot(json.loads(Path(a.replot).read_text()), Path(a.replot).with_suffix(".png"))
        return 0
    torch.set_num_threads(1)  # the host path of a GPU step is one thread; steadier timings
    if a.worker:
        return worker(a)
    why = mpi_problem()
    if why:
        print(f"bench_host_proxy: no working MPI (the engine's communicators need one, even at world 1): {why}",
              file=sys.stderr)
        return 2
    t0, load0 = time.perf_counter(), os.getloadavg()
    result = {"machine": machine_info(), "torch": torch.__version__, "code": git_info(),
              "commit_given": os.environ.get("ZEROMPI_COMMIT"), "argv": sys.argv[1:], "micro": a.micro,
              "steps": a.steps, "count_steps": a.count_steps, "storage_swap": "gpu",
              "torch_has_storage_swap": hasattr(torch.UntypedStorage, "_swap_data_ptr_"), "models": {}}
    if 1 in a.world:
        result["models"] = run_all(a, 1)
    for w in [w for w in a.world if w > 1]:
        for preset, res in ranks(a, w).items():
            m = result["models"].setdefault(preset, {"skeleton": res["skeleton"]})
            m[f"n{w}"] = {k: v for k, v in res.items() if k != "skeleton"}
    result["seconds"] = time.perf_counter() - t0
    result["load_average"] = {"start": load0, "end": os.getloadavg()}  # other work on the cores: times move
    out = Path(a.out or result_path("host_proxy"))
    write_json(out, result)
    print(f"wrote {out} ({result['seconds']:.1f} s)", flush=True)
    if not a.no_plot:
        try:
            plot(result, out.with_suffix(".png"))
        except ImportError as e:  # the JSON is the result; a machine without matplotlib still gets it
            print(f"bench_host_proxy: no plot ({e})", file=sys.stderr)
    return 0


PANELS = (("CPU ms/step (median; tick: min)", lambda r: [r.get("cpu_s", 0) * 1e3], ("",)),
          ("aten ops/step", lambda r: [r["ops"] - r["view_ops"], r["view_ops"]], ("non-view", "view")),
          ("per step", lambda r: [r.get("collectives") or 0, r["device_scalar_reads"], r["polls_in_backward"]],
           ("collectives", "device reads", "polls in backward")))


def plot(result: dict, png: Path) -> None:
    """Per model (rows): CPU time, ops and the syncing counts of each run at N = 1."""
    from harness import pyplot, save_figure

    plt = pyplot()
    models = list(result["models"])
    fig, axes = plt.subplots(len(models), len(PANELS), figsize=(15, 3.4 * len(models)), squeeze=False)
    for i, preset in enumerate(models):
        res = result["models"][preset]
        runs = [r for r in ("torch", "stage0", "stage1", "stage2", "stage3") if r in res]
        for ax, (title, values, labels) in zip(axes[i], PANELS):
            w = 0.8 / len(labels)
            for k, lab in enumerate(labels):
                ax.bar([j + (k - (len(labels) - 1) / 2) * w for j in range(len(runs))],
                       [values(res[r])[k] for r in runs], w, label=lab or None)
            if title.startswith("CPU"):
                ax.plot(range(len(runs)), [res[r].get("cpu_min_s", 0) * 1e3 for r in runs], "k_", ms=10)
            ax.set_xticks(range(len(runs)), runs)
            ax.set_title(f"{preset}: {title}", fontsize=9)
            if labels[0]:
                ax.legend(fontsize=7)
    m = result["machine"]
    commit = result.get("commit") or (result.get("code") or {}).get("git_commit", "?")[:8]
    save_figure(fig, png, f"host proxy on {m['node']} ({m['cpu_model']}, {m['cores']} cores), zerompi {commit}, "
                          "N = 1; skeleton GPTs")
    print(f"wrote {png}")


if __name__ == "__main__":
    sys.exit(main())
