"""The per-step host work of zerompi's GPU step, counted on the CPU (issue 39): the host
proxy (benchmarks/bench_host_proxy.py) runs the 1B preset's skeleton (its real layout of
parameters, pieces, blocks and units at tiny widths) at N = 1 for one step after a
warm-up, and the counts must meet the issue's targets, so no change can silently add
per-bucket work to the step again:
  stages 0-2: at most 30 collectives and 1 device-scalar read a step, and at most 1.1x
              the aten ops plain torch (bf16 autocast, clip_grad_norm_, fused AdamW)
              dispatches for the same model;
  stage 3:    at most 80 collectives a step and no host poll (Handle.test/wait) inside
              backward.
At commit 5eedfbf these fail (one all-reduce or reduce-scatter + all-gather per 2^22-element
block: 290-940 collectives; 1.4-2.6x torch's ops; 1536 polls in stage 3's backward); they
are the targets of the engine changes of issue 39. The counts are deterministic at N = 1."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import bench_host_proxy as hp  # noqa: E402
import host_proxy_skeleton as hs  # noqa: E402

PRESET = "gpt-1b"


@pytest.fixture(scope="module")
def counts() -> dict:
    a = hp.parse(["--models", PRESET, "--stages", "0,1,2,3", "--world", "1", "--warmup", "1",
                  "--count-steps", "1", "--counts-only"])
    return hp.run_all(a, 1)[PRESET]


def test_skeleton_has_the_real_layout(counts):
    sk = hs.find(PRESET)
    real = {k: hs.sig_dict(v) for k, v in sk.signatures.items()}
    assert real[(2, 1)]["params"] == 292 and real[(3, 1)]["units"] == 25  # the 1B GPT: 24 layers + the rest
    for s in range(4):  # each engine the proxy built laid the skeleton out as the real model
        assert counts[f"stage{s}"]["layout"] == real[(s, 1)], s


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_stages_0_2_few_collectives(counts, stage):
    r = counts[f"stage{stage}"]
    assert r["collectives"] <= 30, \
        f"stage {stage}: {r['collectives']:.0f} collectives a step {r['collectives_by_kind']}"


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_stages_0_2_one_device_read(counts, stage):
    r = counts[f"stage{stage}"]
    assert r["device_scalar_reads"] <= 1, f"stage {stage}: reads {r['reads_by_site']}"


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_stages_0_2_ops_near_plain_torch(counts, stage):
    ops, plain = counts[f"stage{stage}"]["ops"], counts["torch"]["ops"]
    assert ops <= 1.1 * plain, f"stage {stage}: {ops:.0f} aten ops a step, {ops / plain:.2f}x plain torch's {plain:.0f}"


def test_stage3_collectives(counts):
    r = counts["stage3"]
    assert r["collectives"] <= 80, f"stage 3: {r['collectives']:.0f} collectives a step {r['collectives_by_kind']}"


def test_stage3_no_host_poll_in_backward(counts):
    r = counts["stage3"]
    assert r["polls_in_backward"] == 0, f"stage 3: {r['poll_calls'].get('backward')} in backward"


def test_the_counter_tells_device_reads_from_host_reads_and_counts_polls():
    """The machinery the targets rest on: a read of a computed tensor counts, a read of
    torch.tensor(python number) arithmetic does not, Handle.test/wait in backward count."""
    import torch

    import host_proxy_count as hc
    from zerompi.comm.base import DoneHandle

    w = torch.ones(3, requires_grad=True)
    with hc.instrumented(), hc.counting() as rec:
        float(w.detach().sum())                          # a device scalar on a GPU
        float(torch.tensor(2.0, dtype=torch.float64) * 3)  # host-born: no sync there
        h = w.register_hook(lambda g: DoneHandle().test() and None)
        (w * 2).sum().backward()
        h.remove()
    got = rec.summary(1)
    assert got["device_scalar_reads"] == 1 and got["host_scalar_reads"] == 1, got["reads_by_site"]
    assert got["polls_in_backward"] == 1 and got["hook_calls"] == 1
    assert got["ops_by_phase"]["backward"] > 0 and got["copies"] == 0


def test_skeleton_follows_a_device_dependent_bucket(monkeypatch):
    """The real model's bucket is resolved as the engine resolves it for a GPU run: a
    layout.bucket that takes a device (a floor of 2^26 on CUDA, say) gives a skeleton with
    the real layout's fewer, larger blocks."""
    from zerompi.zero import layout

    orig = layout.bucket

    def bucket(cfg, world, stage, precision=None, device=None):
        b, at_least = orig(cfg, world, stage, precision)
        return ((max(b, 1 << 26), False) if device == "cuda" and cfg.bucket_size == "auto" else (b, at_least))
    monkeypatch.setattr(layout, "bucket", bucket)
    hs.find.cache_clear()
    try:
        sk = hs.find("gpt2", worlds=(1,))
        assert sk.real_buckets[(0, 1)] == (1 << 26, False)
        assert hs.sig_dict(sk.signatures[(0, 1)])["blocks"] == 2  # 124M elements in 2^26-element blocks
    finally:
        hs.find.cache_clear()
