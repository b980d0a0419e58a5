"""A short table of bench_gpu_e2e.py results, for the end of the acceptance log (run.sh).

    python benchmarks/gpu_acceptance/e2e_summary.py e2e.json [e2e_1b.json ...]

Per system: tokens/s, the ratio to plain torch (median over the rounds, [min-max]), the
target it is held to (stages 0-2 >= 0.95x at GPT-2 124M and >= 0.97x at the 1B
preset; stage 3 >= 0.90x at 1B and at least FSDP2's ratio) with ok/MISS on the median,
the device-busy fraction (the profiled step's kernel-interval union over the timed step's
time), peak memory, and cProfile's host Python time per step. A file that is missing or
holds {"skipped": why} gets one line saying so; exit 0 always (a report, not a check).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

TARGETS = {"gpt2": {"stage0": 0.95, "stage1": 0.95, "stage2": 0.95},
           "gpt-1b": {"stage0": 0.97, "stage1": 0.97, "stage2": 0.97, "stage3": 0.90}}
COLS = f"{'system':<14}{'tok/s':>10}  {'ratio [min-max]':<22}{'target':<14}{'busy':>6}{'peak GB':>9}{'host py ms':>11}"


def target(preset: str, name: str, systems: dict) -> tuple[str, bool | None]:
    """The target's text and whether the median ratio meets it (None: no target)."""
    ratio = systems.get(name, {}).get("ratio_vs_torch", {}).get("median")
    parts, ok = [], None
    floor = TARGETS.get(preset, {}).get(name)
    if floor is not None:
        parts.append(f">={floor:.2f}")
        ok = ratio is not None and ratio >= floor
    fsdp2 = systems.get("fsdp2", {}).get("ratio_vs_torch", {}).get("median")
    if name == "stage3" and fsdp2 is not None:
        parts.append("fsdp2")
        ok = (ok is not False) and ratio is not None and ratio >= fsdp2
    return ",".join(parts), ok


def row(name: str, rec: dict, preset: str, systems: dict, calib: dict) -> str:
    if "skipped" in rec:
        return f"{name:<14}skipped: {rec['skipped']}"[:110]
    if "tokens_per_s" not in rec:
        return f"{name:<14}ERROR: {rec.get('error', 'no timed round')}"[:110]
    r = rec.get("ratio_vs_torch")
    ratio = f"{r['median']:.3f} [{r['min']:.3f}-{r['max']:.3f}]" if r else ("1" if name == "torch" else "-")
    text, ok = target(preset, name, systems)
    verdict = f"{text} {'ok' if ok else 'MISS'}" if ok is not None else text
    c = calib.get(name, {})
    busy = c.get("device_busy_vs_step")
    peak = rec.get("peak_memory_bytes")
    host = c.get("host_python_us")
    err = "  ERROR: " + rec["error"] if "error" in rec else ""
    return (f"{name:<14}{rec['tokens_per_s']:>10.0f}  {ratio:<22}{verdict:<14}"
            f"{f'{busy:.2f}' if busy is not None else '-':>6}{f'{peak / 1e9:.1f}' if peak else '-':>9}"
            f"{f'{host / 1e3:.1f}' if host is not None else '-':>11}{err}")[:160]


def summary(path: Path) -> list[str]:
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        return [f"{path.name}: no result ({type(e).__name__}: {e})"]
    if "skipped" in d:
        return [f"{path.name}: skipped: {d['skipped']}"]
    s = d.get("scheme", {})
    lines = [f"{path.name}: {d.get('preset')} on {d.get('gpu', d.get('device'))}, micro {d.get('micro')} x "
             f"{d.get('seq')}, {s.get('rounds')} rounds x {s.get('steps_per_block')} steps, groups "
             f"{' | '.join(','.join(g) for g in d.get('groups', []))}", COLS]
    systems = d.get("systems", {})
    lines += [row(n, rec, d.get("preset", ""), systems, d.get("calibration", {})) for n, rec in systems.items()]
    t = d.get("train")
    if t and "error" in t:
        lines.append(f"train (stage 2, corpus): ERROR: {t['error']}")
    elif t:
        lines.append(f"train (stage 2, corpus): loss {t['first_quarter_mean']:.3f} -> {t['last_quarter_mean']:.3f} "
                     f"over {t['steps']} steps, {'fell' if t['loss_fell'] else 'DID NOT FALL'}")
    return lines


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    print("ratio = plain torch's step time / the system's, in the same round; busy = device-busy fraction "
          "of a timed step; host py = cProfile's Python time per step")
    for p in argv:
        print("\n".join(summary(Path(p))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
