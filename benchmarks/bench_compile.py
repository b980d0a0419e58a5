"""Per-block torch.compile in the trainer (`compile = true`): tokens/s with and without.

Runs `python -m zerompi.train` twice per setting, the same config with compile off and on
(inductor by default), and reads each run's metrics.jsonl: the steady tokens/s (median over
the steps after --skip, which hold the compilation), the first step's time (compilation
included) and the losses (compile must not change the training). Settings alternate off/on
so that a change in the machine's load hits both. Writes one JSON (machine and software
recorded); docs/performance.md reports it.

    python benchmarks/bench_compile.py --out benchmarks/results/compile_vm_202611.json --settings 2:3,1:0 --repeat 2

--smoke: the tiny model, 3 steps, one rank, aot_eager (a check that the benchmark runs).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from harness import launch, record, write_json


def one(ranks: int, stage: int, args, compile_on: bool, work: Path) -> dict:
    run_dir = work / f"n{ranks}-s{stage}-{'on' if compile_on else 'off'}-{time.monotonic_ns()}"
    argv = ["-m", "zerompi.train", "--model.preset", args.preset, "--global_batch", str(args.batch),
            "--max_steps", str(args.steps), "--warmup_steps", "2", "--eval_interval", "0",
            "--checkpoint_interval", "0", "--progress", "none", "--zero.stage", str(stage),
            "--run_dir", str(run_dir), "--compile", "true" if compile_on else "false",
            "--compile_backend", args.backend]
    job = launch(ranks, argv, timeout=args.timeout)
    if not job.ok:
        sys.exit(f"{' '.join(argv)} failed ({job.status}):\n{job.tail()}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steady = [r["tokens_per_s"] for r in rows[args.skip:]]
    return {"compile": compile_on, "tokens_per_s": statistics.median(steady),
            "tokens_per_s_all": [r["tokens_per_s"] for r in rows], "first_step_s": rows[0]["step_time"],
            "wall_s": job.elapsed_s, "losses": [r["loss"] for r in rows]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--skip", type=int, default=5, help="steps left out of the steady tokens/s")
    ap.add_argument("--settings", default="1:0,2:3", help="ranks:stage pairs")
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--repeat", type=int, default=1, help="off/on pairs per setting, alternating")
    ap.add_argument("--timeout", type=float, default=1200)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    if args.smoke:
        args.preset, args.batch, args.steps, args.skip, args.settings, args.backend = "tiny", 2, 3, 1, "1:0", "aot_eager"
    results, head = [], record()
    with tempfile.TemporaryDirectory() as tmp:
        for setting in args.settings.split(",") * args.repeat:
            ranks, stage = map(int, setting.split(":"))
            off = one(ranks, stage, args, False, Path(tmp))
            on = one(ranks, stage, args, True, Path(tmp))
            loss_diff = max(abs(a - b) for a, b in zip(off["losses"], on["losses"]))
            results.append({"ranks": ranks, "stage": stage, "off": off, "on": on,
                            "speedup": on["tokens_per_s"] / off["tokens_per_s"], "max_loss_diff": loss_diff})
            print(f"N={ranks} stage {stage}: {off['tokens_per_s']:,.0f} -> {on['tokens_per_s']:,.0f} tokens/s "
                  f"(x{results[-1]['speedup']:.2f}); first step {off['first_step_s']:.1f} s -> "
                  f"{on['first_step_s']:.1f} s; largest loss difference {loss_diff:.2e}", flush=True)
    write_json(args.out, {"what": "trainer tokens/s with per-block torch.compile (compile = true) and without",
                          **head, "config": vars(args), "load_average_at_end": os.getloadavg(),
                          "results": results})


if __name__ == "__main__":
    main()
