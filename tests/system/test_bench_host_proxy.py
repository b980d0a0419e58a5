"""benchmarks/bench_host_proxy.py end to end, as the GPU acceptance step calls it on the
GPU machine's CPU (issue 39): the JSON (counts per run at N = 1 and, through mpiexec, at
N = 2; the fitted prediction), the plot, and one clear line (exit 2) without a working MPI."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from mpirun import launch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "bench_host_proxy.py"
SMALL = ["--models", "gpt2", "--stages", "0,3", "--steps", "1", "--warmup", "1", "--count-steps", "1",
         "--profile-steps", "1"]


def test_cli_writes_counts_fit_and_plot(tmp_path):
    out = tmp_path / "proxy.json"
    r = launch([sys.executable, str(SCRIPT), *SMALL, "--world", "1,2", "--out", str(out)], timeout=300)
    assert r.returncode == 0, r.stdout[-4000:]
    res = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 0
    m = res["models"]["gpt2"]
    # the real GPT-2's layout in the GPU's 2^26-element buckets: 2 blocks, one unit per
    # block at stage 3 (13 units)
    sig = m["skeleton"]["signatures"]
    assert sig["stage0_n1"] == {"params": 148, "pieces": 149, "blocks": 2, "units": 1, "blocks_per_unit": [2]}
    assert sig["stage3_n2"] == {"params": 148, "pieces": 148, "blocks": 13, "units": 13, "blocks_per_unit": [1] * 13}
    for run in ("torch", "stage0", "stage3"):
        assert m[run]["ops"] > 0 and m[run]["cpu_s"] > 0 and m[run]["python_by_package_us"], run
    # alone nothing is communicated or agreed on; over 2 ranks the buckets and rounds are
    assert m["torch"]["collectives"] == 0 == m["stage0"]["collectives"] == m["stage3"]["collectives"]
    assert m["stage3"]["agreement_rounds"] == 0 < m["n2"]["stage3"]["agreement_rounds"]
    assert m["n2"]["stage0"]["collectives_by_kind"]["all_reduce"] >= 1 and m["n2"]["stage3"]["collectives"] > 0
    fit = res["fit"]
    assert set(fit["constants"]) == {"c_op_us", "c_coll_us", "c_hook_us"}
    assert {p["run"] for p in fit["points"]} == {"torch", "stage0", "stage3"}
    assert 0 < fit["predicted"]["gpt2"]["runs"]["stage3"]["ratio"] <= 1


def test_cli_without_mpi_says_so_in_one_line(tmp_path):
    r = launch([sys.executable, str(SCRIPT), *SMALL, "--out", str(tmp_path / "x.json")], timeout=120,
               env={"MPI4PY_LIBMPI": "/nonexistent/libmpi.so.12"}, stderr_apart=True)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "no working MPI" in lines[0] and "libmpi" in lines[0], r.stderr
    assert not (tmp_path / "x.json").exists()
