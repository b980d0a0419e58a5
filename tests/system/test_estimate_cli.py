"""`python -m zerompi.estimate` (zerompi/estimate/cli.py): Table 1, the formula table, the
dry run's text and JSON, configs, and one line for bad input. The command's output through
its main() in this process (each run of the command imports torch: ~2.5 CPU-s saved per
case), the command itself, exit status and all, in a run that succeeds and one that fails.
The planner itself: tests/unit/test_estimate.py."""
from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from mpirun import ROOT
from paper import PAPER_TABLE1
from zerompi.estimate import memory
from zerompi.estimate.cli import main


def command(*args, timeout=300):
    """The command in its own process, as a user runs it."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "zerompi.estimate", *args], capture_output=True, text=True,
                          env=env, timeout=timeout, cwd=ROOT)


def cli(*args):
    """The command's main() in this process (what `python -m zerompi.estimate` calls), with
    what it prints and returns in the shape of a finished process."""
    out, err, cwd = io.StringIO(), io.StringIO(), os.getcwd()
    try:
        os.chdir(ROOT)  # the command's relative paths (configs/...)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(list(args))
    finally:
        os.chdir(cwd)
    return SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())


def test_the_command_prints_table1_as_json_and_exits_0():
    p = command("--table1", "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout) == memory.table1()


def test_cli_table1():
    p = cli("--table1")
    assert p.returncode == 0, p.stderr
    lines = [ln.split() for ln in p.stdout.splitlines() if ln.split() and ln.split()[0] in
             {str(n) for n in PAPER_TABLE1}]
    assert len(lines) == 6
    for ln in lines:
        want = PAPER_TABLE1[int(ln[0])]
        assert ln[1:] == [v for m in ("7.5B", "128B", "1T") for v in want[m]], ln
    # --table1 --json: test_the_command_prints_table1_as_json_and_exits_0, in its own process


def test_cli_params_json():
    p = cli("--params", "7.5e9", "--dp", "1,4,16,64,256,1024", "--json")
    assert p.returncode == 0, p.stderr
    rows = json.loads(p.stdout)["rows"]
    assert len(rows) == 24
    r = next(r for r in rows if r["N"] == 64 and r["stage"] == 2)
    assert r["bytes"] == 2 * 7.5e9 + 14 * 7.5e9 / 64 and r["formula"] == "2Ψ + 14Ψ/N"
    t = cli("--params", "1e12", "--tp", "8", "--precision", "fp32", "--stage", "3")
    assert t.returncode == 0 and "16Ψ/N" in t.stdout, t.stderr


KiB = 1024


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_cli_dry_run_auto_chunks(precision):
    """Issue 17: with bucket_size "auto" (the default) every collective of the 7.5B layout
    at N = 4096 has per-rank chunks of at least 256 KiB in its own bytes (reduce-scatter
    and stage 0's all-reduce in fp32, the reduce dtype; all-gather in the param dtype),
    stages 0-3. "auto" sizes the bucket for the narrowest of them: 2 bytes in bf16 (2^29
    elements, the 1 GiB byte ceiling), 4 in fp32 (2^28)."""
    from zerompi.zero.buckets import auto_elem_bytes, bucket_policy

    p = cli("--model", "gpt-7.5b", "--dry-run", "--dp", "4096", "--precision", precision, "--json")
    assert p.returncode == 0, p.stderr
    res = json.loads(p.stdout)
    assert [r["stage"] for r in res["runs"]] == [0, 1, 2, 3]
    assert all(r["equal_formula"] for r in res["runs"])
    # stage 0 (all-reduce only, fp32) needs no more than fp32's 2^28
    want = {(p, s): 1 << 28 if p == "fp32" or s == 0 else 1 << 29 for p in ("bf16", "fp32") for s in range(4)}
    for s in range(4):  # the engine's own resolution for this run's config gives the dry run's bucket
        assert bucket_policy("auto", 4096, elem_bytes=auto_elem_bytes(precision, "fp32", s)) == \
            (want[precision, s], True)
    pbytes = 2 if precision == "bf16" else 4
    # above its 2^22 floor "auto" is a floor on every block (balanced blocks, none a short
    # remainder) and on every stage-3 unit (sibling layers coalesced, the model's unit
    # takes in leading layers)
    for r in res["runs"]:
        w = want[precision, r["stage"]]
        assert r["bucket"] == w and r["at_least"] and r["requested_block"] == w, r["stage"]
        ops = set()
        for c in r["collectives"]:
            if c["scalars"]:
                continue
            ops.add(c["op"])
            assert c["element_bytes"] == (pbytes if c["op"] == "all_gather" else 4), c
            assert c["chunk_elements"] * c["element_bytes"] >= 256 * KiB, (precision, r["stage"], c)
        assert ops == ({"all_reduce"} if r["stage"] == 0 else {"reduce_scatter", "all_gather"})
        s = r["summary"]
        for op in ops:
            assert s["by_op"][op]["smallest_chunk_bytes"] >= 256 * KiB, (r["stage"], op, s)
        assert s["smallest_chunk_bytes"] == min(s["by_op"][op]["smallest_chunk_bytes"] for op in ops)
        # the reducer's buffers: ~2 largest blocks per slot, fp32
        assert r["buffers"] == 2 * (2 * r["block"] + r["block"] // 4096) * 4, r["stage"]
    # measured (docs/scaling.md): smallest / largest chunk elements, units, buffers
    if precision == "bf16":
        assert [(r["summary"]["smallest_chunk_elements"], r["summary"]["largest_chunk_elements"])
                for r in res["runs"]] == [(67_488, 67_504)] + [(140_176, 140_192)] * 2 + [(147_504, 196_672)]
        assert res["runs"][3]["units"] == 12 and res["runs"][3]["summary"]["smallest_chunk_bytes"] == 295_008
        assert [r["buffers"] for r in res["runs"]] == [4_424_482_176] + [9_188_744_448] * 2 + [12_890_669_568]
    else:  # fp32: the 2^28 bucket as before the byte ceiling
        assert [(r["summary"]["smallest_chunk_elements"], r["summary"]["largest_chunk_elements"])
                for r in res["runs"]] == [(67_488, 67_504)] * 3 + [(73_744, 101_520)]
        assert res["runs"][3]["units"] == 18  # h.0+<root>, 16 pairs of layers, h.33+h.34+h.35
        assert [r["buffers"] for r in res["runs"]] == [4_424_482_176] * 3 + [6_654_026_880]


def test_cli_dry_run():
    text = cli("--model", "gpt-7.5b", "--dry-run", "--dp", "4096", "--stage", "3")
    assert text.returncode == 0 and "recounted from layout.pieces" in text.stdout, text.stderr
    # the text names the resolved bucket, the buffers it costs and the smallest chunk per op
    assert "536,870,912 (floor on blocks)" in text.stdout and "12,890,669,568 B" in text.stdout, text.stdout
    assert "AG 288.1 KiB, RS 576.2 KiB" in text.stdout, text.stdout
    # a fixed 4M bucket at N = 4096 is a budget: balanced blocks of at most 4M, 1,008-1,024
    # elements per rank (before balancing the last block of a span left 608, and each
    # stage-3 layer a 65,536-element tail block: 16 per rank); no coalescing (37 units)
    fixed = json.loads(cli("--model", "gpt-7.5b", "--dry-run", "--dp", "4096", "--bucket-size", "4M",
                           "--json").stdout)["runs"]
    assert [(r["summary"]["smallest_chunk_elements"], r["summary"]["largest_chunk_elements"]) for r in fixed] \
        == [(1008, 1024), (1008, 1024), (1008, 1024), (992, 1008)]
    assert not fixed[0]["at_least"] and fixed[3]["units"] == 37


def test_cli_config():
    p = cli("--config", "configs/tiny.toml", "--mem-per-rank", "2GiB")
    assert p.returncode == 0, p.stderr
    assert "max b" in p.stdout and "Collectives of one step" not in p.stdout  # 6 N values
    j = cli("--config", "configs/tiny.toml", "--mem-per-rank", "2GiB", "--dp", "2", "--link", "shm", "--json")
    run = json.loads(j.stdout)["runs"][0]
    assert run["stage"] == 2 and run["micro_batch"] == 16        # configs/tiny.toml: stage 2, 32 / 2
    assert run["fit"]["by_strategy"]["checkpoint"]["micro_batch"] >= run["fit"]["by_strategy"]["none"]["micro_batch"]
    assert 0 <= run["comm_time"]["latency_fraction"] <= 1 and run["comm_time"]["link"]["name"] == "shm"
    a = cli("--model", "gpt-7.5b", "--dp", "1024", "--stage", "3", "--alpha", "2e-6", "--beta", "1e-11",
            "--bucket-size", "auto")
    assert a.returncode == 0 and "custom" in a.stdout, a.stderr


def test_cli_bad_input_is_one_line():
    """The command's own process: exit 2, one line, no traceback. The bad inputs one by
    one, through the same main(): tests/unit/test_estimate_cli_input.py."""
    p = command("--model", "nope")
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert p.stderr.startswith("zerompi.estimate: error: ")
