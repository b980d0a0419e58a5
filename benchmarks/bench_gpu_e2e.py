"""One-GPU end to end: the reference GPT trained by plain torch, torch
FSDP2, zerompi stages 0-3 and DeepSpeed ZeRO-2/3 (benchmarks/e2e_systems.py), all at world
size 1 with the same model, micro-batch and data, in one process; tokens/s per system and
as a ratio to plain torch measured in the same round, MFU, peak memory, and a device- and
host-side profile of one step of each system (benchmarks/step_profile.py).

    python benchmarks/bench_gpu_e2e.py --preset gpt2 --micro 8 --seq 1024 \\
        --systems torch,fsdp2,stage0,stage1,stage2,stage3/deepspeed2,deepspeed3 \\
        --peak-flops 989e12 --out e2e.json
    python benchmarks/gpu_acceptance/e2e_summary.py e2e.json      # the table

Every system is built once and warmed up (--warmup steps), then timed in --rounds rounds,
each a block of --steps steps per system, in list order in even rounds and reversed in odd
ones, so a drift of the machine's speed falls on all alike. A system's ratio to plain torch
is taken per round (the blocks of the same round): median, min and max over the rounds;
tokens/s from the median block. `/` in --systems starts a new group, measured after the
previous one is freed; plain torch is built first, stays, and is timed in every group
(DeepSpeed goes last, in a group of its own: what it sets up process-wide comes after the
others). On a GPU a group also ends early when the free memory is below 1.25x the largest
peak so far + 2 GiB, or when a build runs out of memory (retried once in a fresh group).
Peak memory = what a system holds after its warm-up + the most one of its steps allocates
on top, so systems built side by side do not count each other's memory.

MFU = tokens/s x (6 N + 12 L C T) / peak (GPT's flops per token, N non-embedding
parameters). `--backend` is zerompi's comm.backend (at one rank neither moves data).
`--train-steps K` adds a zerompi stage-2 run on the built-in corpus (the loss must fall).
`--device cpu --preset tiny` runs the same code on the CPU (FSDP2 and DeepSpeed over gloo;
a check, not a measurement). A system that fails records its error and the others go on;
the JSON is rewritten after every part. Exit 1 when a system or a profile failed (a peer
that does not import is skipped) or the corpus run's loss did not fall.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

from harness import machine_info  # first: puts this checkout's zerompi on sys.path
import zerompi  # noqa: E402
from zerompi.models.gpt import PRESETS, count_params  # noqa: E402
from e2e_systems import batches, build, check_names, end_process_group, engine_config, new_model  # noqa: E402
from step_profile import profile_step, release, sync  # noqa: E402

GiB = 1 << 30
POOL = 4  # distinct batches, made once on the device and shared by every system


def load_corpus(max_bytes: int = 4 << 20) -> torch.Tensor:
    import numpy as np

    from zerompi.data import default_corpus

    return torch.from_numpy(np.fromfile(default_corpus(max_bytes=max_bytes), dtype=np.uint16).astype(np.int64))


def error_of(what: str, e: BaseException) -> dict:
    traceback.print_exc()
    print(f"bench_gpu_e2e: {what} failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
    return {"error": f"{type(e).__name__}: {e}"}


def flops_per_token(cfg, seq: int) -> int:
    return 6 * count_params(cfg, non_embedding=True) + 12 * cfg.n_layer * cfg.n_embd * seq


def parse_groups(spec: str) -> list[list[str]]:
    """"a,b/c" -> [["torch", "a", "b"], ["c"]]: plain torch first, once."""
    groups = [[n for n in g.split(",") if n and n != "torch"] for g in spec.split("/")]
    check_names([n for g in groups for n in g])
    groups[0].insert(0, "torch")
    return [g for g in groups if g]


class Run:
    def __init__(self, a, cfg, dev: torch.device, out: Path, result: dict):
        self.a, self.cfg, self.dev, self.out, self.result = a, cfg, dev, out, result
        self.cuda = dev.type == "cuda"
        self.pool = list(batches(cfg, a.micro, a.seq, dev, POOL))
        self.built: dict = {}  # name -> System, in build order (plain torch first)
        self.profile = set() if a.profile == "none" else None if a.profile == "all" else set(a.profile.split(","))
        result.update(systems={}, groups=[], calibration={})

    def rec(self, name: str) -> dict:
        return self.result["systems"].setdefault(name, {})

    def save(self) -> None:
        self.out.write_text(json.dumps(self.result, indent=1))  # as it goes: a cut-off run keeps what it has

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.dev) if self.cuda else 0

    def steps(self, system, n: int, start: int) -> tuple[float, int, float]:
        """n steps from pool batch `start`: seconds per step, the most they allocated on
        top of what was allocated before, the last loss."""
        sync(self.dev)
        base = self.allocated()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.dev)
        t0 = time.perf_counter()
        for i in range(n):
            loss = system.step(*self.pool[(start + i) % POOL])
        sync(self.dev)
        dt = (time.perf_counter() - t0) / n
        extra = torch.cuda.max_memory_allocated(self.dev) - base if self.cuda else 0
        return dt, extra, float(loss.detach())

    def drop(self, name: str, err: dict | None = None) -> None:
        if err:
            self.rec(name).update(err)
        s = self.built.pop(name, None)
        if s is not None:
            s.close()
        release(self.dev)

    def fits(self) -> bool:
        """Room for one more system beside the built ones (always, with nothing to free)."""
        if not self.cuda or len(self.built) < 2:
            return True
        need = 1.25 * max(self.rec(n).get("peak_memory_bytes", 0) for n in self.built) + 2 * GiB
        free, _ = torch.cuda.mem_get_info(self.dev)
        return free + torch.cuda.memory_reserved(self.dev) - torch.cuda.memory_allocated(self.dev) >= need

    def add(self, name: str) -> str:
        """Build and warm up `name`: "ok", "skip", "oom" (nothing recorded) or "error"."""
        r, before, t0, s = self.rec(name), self.allocated(), time.perf_counter(), None
        try:
            s = build(name, self.cfg, self.a.micro, self.a.backend, self.dev)
            if isinstance(s, dict):
                r.update(s)
                print(f"{name}: skipped: {s['skipped']}", flush=True)
                return "skip"
            built = time.perf_counter()
            for i in range(self.a.warmup - 1):
                s.step(*self.pool[i % POOL])
            _, extra, loss = self.steps(s, 1, self.a.warmup - 1)  # the last warm-up step: its memory
        except Exception as e:  # noqa: BLE001  one system's failure costs its own numbers
            if s is not None and not isinstance(s, dict):
                s.close()
            s = None
            release(self.dev)
            if isinstance(e, torch.cuda.OutOfMemoryError) and len(self.built) > 1:
                print(f"{name}: out of memory beside {', '.join(self.built)}: retried in a new group", flush=True)
                return "oom"
            r.update(error_of(f"{name} (build)", e))
            self.save()
            return "error"
        r.update(s.info, build_s=built - t0, warmup_s=time.perf_counter() - built, warmup_loss=loss)
        if self.cuda:
            r["resident_bytes"] = self.allocated() - before
            r["peak_memory_bytes"] = r["resident_bytes"] + extra
        self.built[name] = s
        self.save()
        return "ok"

    def run(self, groups: list[list[str]]) -> None:
        for group in groups:
            for name in group:
                if not self.fits():
                    self.measure()
                if self.add(name) == "oom":
                    self.measure()
                    self.add(name)
            self.measure()
        for name in list(self.built):
            self.drop(name)

    def measure(self) -> None:
        """Rounds over the built systems, then their profiles; then all but torch are freed."""
        members = list(self.built)
        if members == ["torch"] and "step_s" in self.rec("torch"):
            return  # nothing new to compare
        gi = len(self.result["groups"])
        self.result["groups"].append(members)
        times: dict[str, list] = {n: [None] * self.a.rounds for n in members}
        for r in range(self.a.rounds):
            for name in members if r % 2 == 0 else members[::-1]:
                if name not in self.built:
                    continue  # failed in an earlier round
                try:
                    dt, extra, loss = self.steps(self.built[name], self.a.steps, r * self.a.steps)
                except Exception as e:  # noqa: BLE001
                    self.drop(name, error_of(f"{name} (round {r})", e))
                    continue
                times[name][r] = dt
                rec = self.rec(name)
                rec["loss"] = loss
                if self.cuda:
                    rec["peak_memory_bytes"] = max(rec["peak_memory_bytes"], rec["resident_bytes"] + extra)
        for name in members:
            self.record(name, gi, times[name], times.get("torch", [None] * self.a.rounds))
        self.save()
        wanted = members if self.profile is None else [n for n in members if n in self.profile]
        for name in wanted:
            if name in self.built and "profile" not in self.rec(name):
                self.profile_one(name)
        for name in members:
            if name != "torch":
                self.drop(name)

    def record(self, name: str, gi: int, mine: list, base: list) -> None:
        rec = self.rec(name)
        rec.setdefault("groups", []).append(gi)
        rounds = rec.setdefault("rounds_step_s", [])
        rounds.extend(mine)
        done = [t for t in rounds if t is not None]
        if not done:
            return
        rec["step_s"] = statistics.median(done)
        rec["tokens_per_s"] = self.a.micro * self.a.seq / rec["step_s"]
        fpt = flops_per_token(self.cfg, self.a.seq)
        rec["mfu"] = rec["tokens_per_s"] * fpt / self.a.peak_flops if self.a.peak_flops else None
        ratios = [b / t for t, b in zip(mine, base) if t is not None and b is not None]
        if ratios and name != "torch":
            rec["ratio_vs_torch"] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios),
                                     "rounds": ratios}
            rec["tokens_ratio_vs_torch"] = rec["ratio_vs_torch"]["median"]
        ratio = rec.get("ratio_vs_torch")
        print(f"{name}: {rec['tokens_per_s']:.0f} tok/s"
              + (f", {ratio['median']:.3f}x torch [{ratio['min']:.3f}-{ratio['max']:.3f}]" if ratio else "")
              + (f", MFU {rec['mfu']:.1%}" if rec.get("mfu") else ""), flush=True)

    def profile_one(self, name: str) -> None:
        rec = self.rec(name)
        try:
            p = profile_step(self.built[name].step, self.pool[0], self.dev, cprofile_steps=self.a.profile_steps)
        except Exception as e:  # noqa: BLE001
            rec["profile"] = error_of(f"{name} (profile)", e)
            self.save()
            return
        rec["profile"] = p
        step_us = rec.get("step_s", 0) * 1e6
        self.result["calibration"][name] = {
            "step_s": rec.get("step_s"), "device_busy_us": p["device_busy_us"],
            "device_kernel_us": p["device_kernel_us"], "device_busy": p["device_busy"],
            "profiled_step_us": p["profiled_step_us"],
            "device_busy_vs_step": p["device_busy_us"] / step_us if self.cuda and step_us else None,
            "host_python_us": sum(p["python_by_package"].values()), "host_totals": p["host_totals"]}
        self.save()
        if p["device_busy"] is not None:
            print(f"{name}: device busy {p['device_busy']:.0%} of a profiled step, "
                  f"{self.result['calibration'][name]['device_busy_vs_step']:.0%} of a timed one", flush=True)


def train_run(cfg, a, dev, corpus: torch.Tensor) -> dict:
    """zerompi stage 2 on the corpus for a.train_steps steps: the loss must fall."""
    engine = zerompi.initialize(new_model(cfg, dev), engine_config(a.backend, 2, lr=1e-3))
    losses = []
    t0 = time.perf_counter()
    for x, y in batches(cfg, a.micro, a.seq, dev, a.train_steps, corpus):
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach())
    losses = [float(v) for v in losses]  # one read of the device, after the run
    k = max(1, len(losses) // 4)
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    return {"stage": 2, "steps": len(losses), "seconds": time.perf_counter() - t0, "losses": losses,
            "first_quarter_mean": first, "last_quarter_mean": last, "loss_fell": last < 0.8 * first,
            "backend": type(engine.comm).__name__}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="gpt-1b", choices=sorted(PRESETS))
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--systems", default="torch,fsdp2,stage0,stage1,stage2,stage3",
                    help="comma-separated (e2e_systems.py), '/' starts a new group; plain torch always, first")
    ap.add_argument("--warmup", type=int, default=3, help="steps per system after its build (>= 1)")
    ap.add_argument("--rounds", type=int, default=6, help="timed rounds, the order reversed every other one")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per system per round")
    ap.add_argument("--profile", default="all", help='systems to profile: "all", "none" or a list')
    ap.add_argument("--profile-steps", type=int, default=3, help="cProfile'd steps per profiled system")
    ap.add_argument("--peak-flops", type=float, default=0.0, help="per device, dense bf16")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--backend", default="auto", choices=["auto", "nccl", "mpi"], help="zero.comm.backend")
    ap.add_argument("--train-steps", type=int, default=0, help="a stage-2 run on the built-in corpus")
    ap.add_argument("--out", default="benchmarks/results/gpu_e2e.json")
    a = ap.parse_args(argv)
    if min(a.warmup, a.rounds, a.steps, a.profile_steps) < 1:
        ap.error("--warmup, --rounds, --steps and --profile-steps must be >= 1")
    try:
        groups = parse_groups(a.systems)
    except ValueError as e:
        ap.error(str(e))
    dev = torch.device(a.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("bench_gpu_e2e: no CUDA device visible", file=sys.stderr)
        return 2
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())  # torch.cuda.set_device needs the index
    zerompi.runtime.init()
    cfg = PRESETS[a.preset]
    if a.seq > cfg.block_size:
        ap.error(f"--seq {a.seq} > the preset's block_size {cfg.block_size}")
    result = {"machine": machine_info(), "torch": torch.__version__, "preset": a.preset, "micro": a.micro,
              "seq": a.seq, "device": str(dev), "backend": a.backend, "peak_flops": a.peak_flops,
              "scheme": {"warmup": a.warmup, "rounds": a.rounds, "steps_per_block": a.steps,
                         "order": "list order in even rounds, reversed in odd ones", "systems": a.systems}}
    if dev.type == "cuda":
        result["gpu"] = torch.cuda.get_device_name(dev)
        result["gpu_memory_bytes"] = torch.cuda.get_device_properties(dev).total_memory
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    run = Run(a, cfg, dev, out, result)
    run.run(groups)
    if a.train_steps:
        try:
            rec = train_run(cfg, a, dev, load_corpus())
        except Exception as e:  # noqa: BLE001
            rec = error_of("corpus run", e)
        result["train"] = rec
        run.save()
        release(dev)
        if "error" not in rec:
            print(f"train: loss {rec['first_quarter_mean']:.3f} -> {rec['last_quarter_mean']:.3f} "
                  f"over {rec['steps']} steps ({'fell' if rec['loss_fell'] else 'DID NOT FALL'})", flush=True)
    end_process_group()
    failed = [k for k, v in result["systems"].items() if "error" in v or "error" in v.get("profile", {})]
    failed += ["train"] if "error" in result.get("train", {}) else []
    fell = result.get("train", {}).get("loss_fell", True)  # a run that does not learn fails
    return 1 if failed or not fell else 0


if __name__ == "__main__":
    sys.exit(main())
