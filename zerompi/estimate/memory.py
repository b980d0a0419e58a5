"""Model-state memory per rank: the ZeRO paper's formulas, its Table 1, byte units.

Per rank, with Psi parameters (Psi / tp under tensor parallelism), N data-parallel ranks,
p / g bytes per stored parameter / gradient and K optimizer-state bytes per parameter:

  stage 0 (DP)          (p + g + K) Psi
  stage 1 (P_os)        (p + g) Psi + K Psi / N
  stage 2 (P_os+g)      p Psi + (g + K) Psi / N
  stage 3 (P_os+g+p)    (p + g + K) Psi / N

bf16/fp16 (the paper's mixed precision): p = g = 2, K = 12 (fp32 master 4 + Adam's two
moments 8). fp32: p = g = 4, K = 8 (the parameters are the master). The engine's
`grad_accum_dtype = "fp32"` stores gradients in fp32: g = 4. The engine counts the same
terms at the padded element count T (T - Psi < N x alignment, per stage-3 unit) instead
of Psi; `model_states(T, ...)` is then exact (tests/multirank/test_accounting.py `expected()`).
"""
from __future__ import annotations

import re
from decimal import ROUND_FLOOR, ROUND_HALF_UP, Decimal
from fractions import Fraction

PRECISIONS = ("fp32", "bf16", "fp16")
STAGE_NAMES = {0: "DP", 1: "P_os", 2: "P_os+g", 3: "P_os+g+p"}
GB, GiB = 10**9, 2**30


def element_bytes(precision: str, grad_accum_dtype: str = "param") -> dict[str, int]:
    """Bytes per parameter of each model-state term (before partitioning)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}: must be one of {', '.join(PRECISIONS)}")
    if grad_accum_dtype not in ("param", "fp32"):
        raise ValueError(f"grad_accum_dtype {grad_accum_dtype!r}: must be param or fp32")
    mixed = precision != "fp32"
    return {"params": 2 if mixed else 4,
            "grads": 4 if (grad_accum_dtype == "fp32" or not mixed) else 2,
            "master": 4 if mixed else 0,
            "optimizer": 8}


def partitioned_terms(stage: int) -> set[str]:
    """Which terms are divided by N at this stage."""
    if stage not in STAGE_NAMES:
        raise ValueError(f"stage {stage!r}: must be 0, 1, 2 or 3")
    return {0: set(), 1: {"master", "optimizer"}, 2: {"master", "optimizer", "grads"},
            3: {"master", "optimizer", "grads", "params"}}[stage]


def _num(x: Fraction) -> int | float:
    return int(x) if x.denominator == 1 else float(x)


def model_states(psi: int | float, n: int, stage: int, precision: str = "bf16",
                 grad_accum_dtype: str = "param", tp: int = 1) -> dict[str, int | float]:
    """Bytes per rank by term (the keys of the engine's memory_report()) and their sum
    `model_states`. Exact integers when the division is exact (always at the engine's
    padded T); floats otherwise."""
    if n < 1 or tp < 1:
        raise ValueError(f"N and tp must be >= 1 (got N = {n}, tp = {tp})")
    per = element_bytes(precision, grad_accum_dtype)
    part = partitioned_terms(stage)
    base = Fraction(psi) / tp
    out = {k: b * base / (n if k in part else 1) for k, b in per.items()}
    out["model_states"] = sum(out.values())
    return {k: _num(v) for k, v in out.items()}


def formula(stage: int, precision: str = "bf16", grad_accum_dtype: str = "param") -> str:
    """The per-rank model-state bytes in the paper's units, e.g. '2Ψ + 14Ψ/N'."""
    per = element_bytes(precision, grad_accum_dtype)
    part = partitioned_terms(stage)
    rep = sum(b for k, b in per.items() if k not in part)
    div = sum(b for k, b in per.items() if k in part)
    terms = ([f"{rep}Ψ"] if rep else []) + ([f"{div}Ψ/N"] if div else [])
    return " + ".join(terms)


def model_state_rows(psi: float, dps, stages=(0, 1, 2, 3), precision: str = "bf16",
                     grad_accum_dtype: str = "param", tp: int = 1) -> list[dict]:
    """One row per (N, stage): formula, bytes, GB (1e9) and GiB (2^30)."""
    rows = []
    for n in dps:
        for s in stages:
            m = model_states(psi, n, s, precision, grad_accum_dtype, tp)
            b = m["model_states"]
            rows.append({"N": n, "stage": s, "name": STAGE_NAMES[s],
                         "formula": formula(s, precision, grad_accum_dtype),
                         "bytes": b, "GB": b / GB, "GiB": b / GiB, "terms": m})
    return rows


# ------------------------------------------------------------------ Table 1 of the paper
TABLE1_MODELS = ((7.5e9, "7.5B"), (128e9, "128B"), (1e12, "1T"))
TABLE1_DP = (1, 4, 16, 64, 256, 1024)


def paper_round(x: Fraction | float | int) -> str:
    """A number as the paper's Table 1 prints it: >= 100 truncated to an integer
    (513.5 -> 513, 2218.75 -> 2218), 10..100 to one decimal and below 10 to two decimals,
    both rounded half up (41.25 -> 41.3, 1.875 -> 1.88), trailing zeros dropped
    (7.50 -> 7.5, 32.0 -> 32). Exact decimal arithmetic: no binary rounding surprises."""
    d = Decimal(x.numerator) / Decimal(x.denominator) if isinstance(x, Fraction) else Decimal(str(x))
    if d >= 100:
        q = d.quantize(Decimal(1), rounding=ROUND_FLOOR)
    else:
        q = d.quantize(Decimal("0.1") if d >= 10 else Decimal("0.01"), rounding=ROUND_HALF_UP)
    s = format(q, "f")
    return s.rstrip("0").rstrip(".") if "." in s else s


def table1() -> list[dict]:
    """Table 1 of the paper from our formulas: GB (1e9 bytes) per device, mixed-precision
    Adam (K = 12), for P_os, P_os+g, P_os+g+p. `exact_GB` keeps the unrounded value."""
    rows = []
    for n in TABLE1_DP:
        for psi, label in TABLE1_MODELS:
            row = {"N": n, "model": label, "psi": int(psi)}
            for s in (1, 2, 3):
                exact = Fraction(model_states(int(psi), n, s, "bf16")["model_states"]) / GB
                row[STAGE_NAMES[s]] = paper_round(exact)
                row[f"{STAGE_NAMES[s]}_exact_GB"] = float(exact)
            rows.append(row)
    return rows


# ------------------------------------------------------------------ byte units
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """'80GiB', '80 GB', '2e9', '512MiB' -> bytes (GB = 1e9, GiB = 2^30)."""
    m = re.fullmatch(r"\s*([0-9.]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a size: use e.g. 80GiB, 40GB, 512MiB or a byte count")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if not value > 0:
        raise ValueError(f"size {text!r} must be > 0")
    return int(value)


def parse_count(text: str) -> int:
    """'4M' (2^22), '4e6', '65536', '1Mi' -> an element count (K/M/G are binary here, as
    bucket sizes are powers of two: 4M = 4,194,304, the engine's default)."""
    m = re.fullmatch(r"\s*([0-9.]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMgG]?)i?\s*", str(text))
    if not m:
        raise ValueError(f"cannot read {text!r} as an element count: use e.g. 4M, 65536 or 1e6")
    value = float(m.group(1)) * {"": 1, "k": 2**10, "m": 2**20, "g": 2**30}[m.group(2).lower()]
    if value < 1 or value != int(value):
        raise ValueError(f"element count {text!r} must be a whole number >= 1")
    return int(value)


def human(nbytes: float, unit: str = "GiB") -> str:
    """Bytes in GiB (or another unit of _UNITS), 3 significant digits."""
    v = nbytes / _UNITS[unit.lower()]
    return f"{v:.3g} {unit}" if v < 1000 else f"{v:,.0f} {unit}"
