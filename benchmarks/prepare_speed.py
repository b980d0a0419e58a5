"""Speed of `python -m zerompi.prepare` in tokens/s, and its peak memory.

    python benchmarks/prepare_speed.py [--smoke] [--mb 32] [--workers 1,2] [--out PATH]

Writes a synthetic JSONL corpus (--mb of English-like documents, made here: nothing is
downloaded), trains a byte-level BPE tokenizer on a slice of it with `tokenizers` (vocab
8192, GPT-2's kind), then prepares the corpus with that tokenizer and with bytes as
tokens, for each worker count, in a fresh process each time. Reports tokens/s (all
tokens written, over the command's wall time including its start), input MB/s and the
peak resident memory of the main process and of its largest worker; also tokens per
CPU-second (user + system time of the command and its workers), which a machine shared
with other work changes less than the wall time (the load average is recorded). --smoke: 1 MB, one
worker, no result file unless --out is given (a check that the benchmark runs).
Result: benchmarks/results/prepare_speed_vm_202611.json (the machine is recorded in it).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULT = ROOT / "benchmarks" / "results" / "prepare_speed_vm_202611.json"
WORDS = ("the of and to in is was for on that with as by at from his her an were are which this be "
         "data model training tokens shard epoch window river mountain city music history science "
         "government people world year time work school system program number water light").split()

CHILD = """
import json, resource, sys, time
t0 = time.perf_counter()
from zerompi.data.prepare import prepare
r = prepare([sys.argv[1]], sys.argv[2], sys.argv[3], workers=int(sys.argv[4]), unit_mb=float(sys.argv[5]),
            progress=False)
wall = time.perf_counter() - t0
hwm = [int(l.split()[1]) * 1024 for l in open('/proc/self/status') if l.startswith('VmHWM')][0]
cpu = sum(getattr(resource.getrusage(w), k) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
          for k in ("ru_utime", "ru_stime"))
print(json.dumps({"tokens": r["new_tokens"], "seconds": wall, "tokenize_seconds": r["seconds"], "units": r["units"],
                  "cpu_seconds": cpu,
                  "main_peak_rss": hwm,
                  "worker_peak_rss": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024}))
"""


def corpus(path: Path, mb: float, seed: int = 0) -> None:
    rng = random.Random(seed)
    with open(path, "w") as f:
        size, i = 0, 0
        while size < mb * 2**20:
            n = rng.randint(50, 800)
            text = " ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + "."
            line = json.dumps({"id": i, "text": text}) + "\n"
            f.write(line)
            size, i = size + len(line), i + 1


def tokenizer(path: Path, sample: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    lines = [json.loads(x)["text"] for x, _ in zip(open(sample), range(2000))]
    tok.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=8192, special_tokens=["<|endoftext|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                       show_progress=False))
    tok.save(str(path))


def machine() -> dict:
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "")
    ram = next((int(ln.split()[1]) * 1024 for ln in open("/proc/meminfo") if ln.startswith("MemTotal")), 0)
    return {"node": platform.node(), "cpu_model": cpu, "cores": os.cpu_count(), "ram_bytes": ram,
            "platform": platform.platform(), "python": platform.python_version(),
            "load_average_at_start": os.getloadavg()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="1 MB, one worker, no result file unless --out")
    ap.add_argument("--mb", type=float, default=32.0, help="input size in MB (32)")
    ap.add_argument("--workers", default="1,2", help="worker counts (1,2)")
    ap.add_argument("--unit_mb", type=float, default=4.0, help="prepare's --unit_mb (4)")
    ap.add_argument("--out", default=None, help=f"result JSON (default {RESULT.relative_to(ROOT)})")
    a = ap.parse_args(argv)
    mb, workers = (1.0, [1]) if a.smoke else (a.mb, [int(w) for w in a.workers.split(",")])
    out = Path(a.out) if a.out else (None if a.smoke else RESULT)
    cases = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        corpus(tmp / "in.jsonl", mb)
        tokenizer(tmp / "tokenizer.json", tmp / "in.jsonl")
        env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        for tok in (str(tmp / "tokenizer.json"), "bytes"):
            for w in workers:
                dest = tmp / f"out-{w}-{len(cases)}"
                p = subprocess.run([sys.executable, "-c", CHILD, str(tmp / "in.jsonl"), str(dest), tok, str(w),
                                    str(a.unit_mb)], capture_output=True, text=True, env=env)
                if p.returncode:
                    print(p.stderr, file=sys.stderr)
                    return 1
                r = json.loads(p.stdout.strip().splitlines()[-1])
                r.update(tokenizer="bpe-8192" if tok != "bytes" else "bytes", workers=w, input_mb=mb,
                         tokens_per_s=r["tokens"] / r["seconds"], input_mb_per_s=mb / r["seconds"],
                         tokens_per_cpu_s=r["tokens"] / r["cpu_seconds"])
                cases.append(r)
                print(f"{r['tokenizer']:>9} workers {w}: {r['tokens']:,} tokens in {r['seconds']:.2f} s = "
                      f"{r['tokens_per_s']:,.0f} tokens/s ({r['input_mb_per_s']:.1f} MB/s of JSONL; "
                      f"{r['tokens_per_cpu_s']:,.0f} per CPU-second); peak RSS main "
                      f"{r['main_peak_rss'] / 2**20:.0f} MB, worker {r['worker_peak_rss'] / 2**20:.0f} MB")
    result = {"benchmark": "prepare_speed", "machine": machine(), "argv": sys.argv[1:],
              "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "smoke": a.smoke, "cases": cases}
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
