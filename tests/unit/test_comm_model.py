"""The alpha-beta communication model and the "auto" bucket size (zerompi/comm/cost_model.py):
single process, no MPI, no torch."""
from __future__ import annotations

import math
import random

import pytest

from zerompi.comm.cost_model import (
    OPS,
    PRESETS,
    Link,
    collective_time,
    fit,
    latency_share,
    resolve_link,
    step_comm_time,
)
from zerompi.zero.buckets import AUTO_CEILING_BYTES, AUTO_FLOOR, auto_bucket_elements

L = Link("test", alpha=2e-6, beta=1e-9)
KiB = 1024


def close(a, b):
    return math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-18)


# ------------------------------------------------------------------ formulas at known points
@pytest.mark.parametrize("op", ["reduce_scatter", "all_gather", "all_to_all"])
def test_ring_one_phase_ops(op):
    t, lat = collective_time(op, 1 << 20, 4, L)
    assert close(lat, 3 * L.alpha)
    assert close(t, 3 * L.alpha + 0.75 * (1 << 20) * L.beta)


def test_ring_all_reduce_is_twice_reduce_scatter():
    for n in (2, 3, 4, 17, 4096):
        rs = collective_time("reduce_scatter", 12345, n, L)
        ar = collective_time("all_reduce", 12345, n, L)
        assert close(ar[0], 2 * rs[0]) and close(ar[1], 2 * rs[1])
    t, lat = collective_time("all_reduce", 1000, 8, L)
    assert close(lat, 14 * L.alpha) and close(t, 14 * L.alpha + 2 * 7 / 8 * 1000 * L.beta)


def test_tree_variants():
    # binomial-tree broadcast: lg n steps, each the whole buffer
    t, lat = collective_time("broadcast", 1000, 8, L, algo="tree")
    assert close(lat, 3 * L.alpha) and close(t, 3 * (L.alpha + 1000 * L.beta))
    # tree all-reduce: 2 lg n steps, bandwidth term as the ring's
    t, lat = collective_time("all_reduce", 1000, 8, L, algo="tree")
    assert close(lat, 6 * L.alpha) and close(t, 6 * L.alpha + 2 * 7 / 8 * 1000 * L.beta)
    # non-power-of-two: ceil(log2 n)
    assert close(collective_time("broadcast", 0, 5, L, algo="tree")[1], 3 * L.alpha)
    assert close(collective_time("reduce_scatter", 0, 4096, L, algo="tree")[1], 12 * L.alpha)


def test_ring_broadcast_is_scatter_plus_allgather():
    t, lat = collective_time("broadcast", 800, 4, L)
    assert close(lat, (2 + 3) * L.alpha) and close(t, 5 * L.alpha + 2 * 0.75 * 800 * L.beta)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("algo", ["ring", "tree"])
def test_one_rank_costs_nothing(op, algo):
    if algo == "tree" and op == "all_to_all":
        return
    assert collective_time(op, 1 << 30, 1, L, algo) == (0.0, 0.0)


def test_zero_bytes_is_pure_latency():
    t, lat = collective_time("all_gather", 0, 4, L)
    assert t == lat == 3 * L.alpha


@pytest.mark.parametrize("kwargs, word", [
    (dict(op="gather"), "op"), (dict(algo="butterfly"), "algo"), (dict(n=0), "n"),
    (dict(n=2.0), "n"), (dict(n=True), "n"), (dict(nbytes=-1), "nbytes"),
    (dict(op="all_to_all", algo="tree"), "all_to_all"),
])
def test_bad_arguments_name_the_argument(kwargs, word):
    args = dict(op="reduce_scatter", nbytes=100, n=4, link=L, algo="ring") | kwargs
    with pytest.raises(ValueError, match=word):
        collective_time(**args)


def test_link_validation_and_presets():
    with pytest.raises(ValueError, match="alpha"):
        Link("x", -1.0, 1e-9)
    with pytest.raises(ValueError, match="beta"):
        Link("x", 1e-6, float("nan"))
    assert set(PRESETS) >= {"shm", "nvlink", "hdr-ib", "ndr-ib", "calibrated-vm"}
    for name, link in PRESETS.items():
        assert link.name == name and link.alpha > 0 and link.beta > 0
    assert math.isclose(PRESETS["hdr-ib"].bandwidth, 25e9)
    assert math.isclose(PRESETS["ndr-ib"].bandwidth, 50e9)
    assert resolve_link("nvlink") == PRESETS["nvlink"]
    assert resolve_link("hdr-ib", alpha=1e-6).alpha == 1e-6
    assert resolve_link(alpha=1e-6, beta=1e-10) == Link("custom", 1e-6, 1e-10)
    with pytest.raises(ValueError, match="preset"):
        resolve_link("ethernet")
    with pytest.raises(ValueError, match="alpha and beta"):
        resolve_link(alpha=1e-6)


# ------------------------------------------------------------------ a step
def test_step_comm_time_sums_rows():
    rows = [("reduce_scatter", 4 << 20, 5), ("all_gather", 4 << 20, 5), ("all_reduce", 64, 1, "tree")]
    r = step_comm_time(rows, 4, L)
    parts = [collective_time("reduce_scatter", 4 << 20, 4, L), collective_time("all_gather", 4 << 20, 4, L),
             collective_time("all_reduce", 64, 4, L, "tree")]
    counts = [5, 5, 1]
    assert close(r["seconds"], sum(c * p[0] for c, p in zip(counts, parts)))
    assert close(r["latency_seconds"], sum(c * p[1] for c, p in zip(counts, parts)))
    assert close(r["latency_fraction"], r["latency_seconds"] / r["seconds"])
    assert close(sum(r["by_op"].values()), r["seconds"])
    assert step_comm_time([], 4, L) == {"seconds": 0.0, "latency_seconds": 0.0,
                                        "latency_fraction": 0.0, "by_op": {}}
    assert step_comm_time(rows, 1, L)["seconds"] == 0.0
    with pytest.raises(ValueError, match="count"):
        step_comm_time([("all_gather", 10, -1)], 4, L)
    with pytest.raises(ValueError, match="row"):
        step_comm_time([("all_gather", 10)], 4, L)


def test_latency_fraction_in_unit_interval():
    rnd = random.Random(0)
    for _ in range(200):
        link = Link("r", rnd.uniform(0, 1e-4), rnd.uniform(1e-12, 1e-8))
        rows = [(rnd.choice(OPS), rnd.randrange(0, 1 << 28), rnd.randrange(0, 50)) for _ in range(4)]
        f = step_comm_time(rows, rnd.randrange(1, 5000), link)["latency_fraction"]
        assert 0.0 <= f <= 1.0
    # smaller buckets for the same bytes: more latency
    big = step_comm_time([("reduce_scatter", 1 << 26, 1)], 64, PRESETS["hdr-ib"])
    small = step_comm_time([("reduce_scatter", 1 << 16, 1 << 10)], 64, PRESETS["hdr-ib"])
    assert small["latency_fraction"] > big["latency_fraction"]


# ------------------------------------------------------------------ auto bucket
NS = [1, 2, 3, 4, 5, 8, 13, 16, 31, 64, 100, 256, 1000, 1024, 4096, 10000]


def test_auto_never_below_floor_and_monotone():
    for link in [None] + list(PRESETS.values()):
        prev = 0
        for n in NS:
            b = auto_bucket_elements(n, link=link)
            assert b >= 1 << 22
            assert b >= prev, (link, n)
            prev = b
    assert auto_bucket_elements(64, floor=1 << 10) >= 1 << 10


def test_auto_unchanged_at_small_n():
    # the 2^22-element floor, whatever the element size, until n x chunk passes it:
    # fp32 n <= 14 (281,264 elements per rank), bf16/fp16 n <= 7 (562,512)
    for n in range(1, 15):
        assert auto_bucket_elements(n) == 1 << 22
    for n in range(1, 8):
        assert auto_bucket_elements(n, elem_bytes=2) == 1 << 22
    assert auto_bucket_elements(15) > 1 << 22 and auto_bucket_elements(8, elem_bytes=2) > 1 << 22


def test_auto_chunk_at_4096_fp32():
    # the default byte ceiling (1 GiB of the narrowest collective) is 2^28 fp32 elements,
    # the pre-byte-ceiling cap exactly: 256 KiB per rank
    assert AUTO_CEILING_BYTES == 1 << 30
    b = auto_bucket_elements(4096, elem_bytes=4)
    assert b == 1 << 28 and b % (4096 * 16) == 0
    assert b // 4096 * 4 == 256 * KiB
    # uncapped, the chunk meets the 10% latency target on the default link
    u = auto_bucket_elements(4096, elem_bytes=4, ceiling_bytes=None)
    assert u % (4096 * 16) == 0 and latency_share(u // 4096 * 4, PRESETS["hdr-ib"]) <= 0.1


def test_auto_chunk_at_4096_two_byte_elements():
    # bf16/fp16 all-gathers: the same 1 GiB ceiling is 2^29 elements (DeepSpeed's default
    # buckets are 5e8), so the 2-byte all-gather chunk is 256 KiB too (a 4-byte-sized
    # bucket, 2^28, would leave it 128 KiB) and an fp32 reduce-scatter of it 512 KiB
    b = auto_bucket_elements(4096, elem_bytes=2)
    assert b == 1 << 29 == AUTO_CEILING_BYTES // 2 and b % (4096 * 16) == 0
    assert b // 4096 * 2 == 256 * KiB and b // 4096 * 4 == 512 * KiB
    # below the ceiling: twice the fp32 elements (the same bytes per chunk, up to rounding)
    for n in (64, 100, 256):
        b2, b4 = auto_bucket_elements(n, elem_bytes=2), auto_bucket_elements(n, elem_bytes=4)
        assert b2 % (n * 16) == 0 and abs(b2 - 2 * b4) <= n * 16, n
        assert latency_share(b2 // n * 2, PRESETS["hdr-ib"]) <= 0.1
    # the ceiling holds bytes, not elements: every n, either element size
    for n in NS:
        for eb in (1, 2, 4, 8):
            assert auto_bucket_elements(n, elem_bytes=eb) * eb <= max(AUTO_CEILING_BYTES, AUTO_FLOOR * eb)


def test_auto_meets_the_latency_target_above_the_floor():
    for link in PRESETS.values():
        for f in (0.05, 0.1, 0.3):
            for n in (64, 1024, 4096):
                for eb in (2, 4):
                    b = auto_bucket_elements(n, eb, link=link, latency_fraction=f, ceiling_bytes=None)
                    if b > 1 << 22:
                        assert b % (n * 16) == 0
                        assert latency_share(b // n * eb, link) <= f + 1e-12
                        # the smallest such: one alignment step less would miss it
                        assert latency_share((b // n - 16) * eb, link) > f


def test_auto_ceiling_and_bad_arguments():
    assert auto_bucket_elements(4096, ceiling_bytes=1 << 30) == 1 << 28
    assert auto_bucket_elements(4096, elem_bytes=2, ceiling_bytes=1 << 30) == 1 << 29
    assert auto_bucket_elements(4096, ceiling_bytes=1 << 26) == 1 << 24
    assert auto_bucket_elements(2, ceiling_bytes=1 << 30) == 1 << 22
    for kw, word in [(dict(n=0), "n"), (dict(elem_bytes=0), "elem_bytes"),
                     (dict(latency_fraction=0), "latency_fraction"),
                     (dict(latency_fraction=1.5), "latency_fraction"), (dict(floor=0), "floor"),
                     (dict(ceiling_bytes=1 << 10), "ceiling_bytes"),
                     (dict(ceiling_bytes=(1 << 24) - 1), "ceiling_bytes")]:  # below floor x 4 bytes
        with pytest.raises(ValueError, match=word):
            auto_bucket_elements(**({"n": 8} | kw))


# ------------------------------------------------------------------ fit
def test_fit_recovers_alpha_beta():
    true = Link("t", 7e-6, 1 / 3e9)
    samples = []
    rnd = random.Random(1)
    for n in (2, 4):
        for k in range(10, 25):
            for op in ("reduce_scatter", "all_gather"):
                t, _ = collective_time(op, 4 << k, n, true)
                samples.append((op, 4 << k, n, t))
    got = fit(samples)
    assert math.isclose(got.alpha, true.alpha, rel_tol=1e-9)
    assert math.isclose(got.beta, true.beta, rel_tol=1e-9)
    # 5% multiplicative noise: still within a few percent
    noisy = [(op, b, n, t * rnd.uniform(0.95, 1.05)) for op, b, n, t in samples]
    got = fit(noisy, name="noisy")
    assert got.name == "noisy"
    assert abs(got.alpha / true.alpha - 1) < 0.05 and abs(got.beta / true.beta - 1) < 0.05


def test_fit_constraints_and_errors():
    # pure bandwidth data: alpha clamps at 0 instead of going negative
    samples = [("all_gather", b, 2, 0.5 * b * 1e-9) for b in (1e3, 1e5, 1e7)]
    got = fit(samples)
    assert got.alpha == 0.0 and math.isclose(got.beta, 1e-9, rel_tol=1e-9)
    with pytest.raises(ValueError, match="two samples"):
        fit([("all_gather", 100, 2, 1e-5)])
    with pytest.raises(ValueError, match="seconds"):
        fit([("all_gather", 100, 2, 0.0), ("all_gather", 1000, 2, 1e-5)])
    with pytest.raises(ValueError, match="op"):
        fit([("gather", 100, 2, 1e-5), ("all_gather", 1000, 2, 1e-5)])


def test_calibrated_preset_is_the_committed_fit():
    """PRESETS["calibrated-vm"] is the N = 2 joint fit of benchmarks/results/comm_calibration_vm-epyc_202611.json
    (rerunning the calibration means updating the preset, its comment and docs/scaling.md)."""
    import json
    from mpirun import ROOT

    res = json.loads((ROOT / "benchmarks/results/comm_calibration_vm-epyc_202611.json")
                     .read_text())
    fitted = res["analysis"]["links"]["2"]
    link = PRESETS["calibrated-vm"]
    assert math.isclose(link.alpha, fitted["alpha"], rel_tol=0.01)
    assert math.isclose(link.beta, fitted["beta"], rel_tol=0.01)
    assert res["machine"]["node"] == "vm"
