"""The staged offload pipeline in one process on the CPU (zero/offload.py): its config
rules, the delayed update against a reference that applies the same delay by hand (bit
for bit: the same gradients, norms and host pass), what reading and replacing the state
do to it, and what the engine reports. On N ranks: tests/multirank/test_offload.py."""
from __future__ import annotations

import gc
import sys
import weakref

import pytest
import torch

import zerompi
from zerompi.config import ConfigError
from zerompi.models.gpt import GPT, PRESETS

from mpirun import WORKERS

sys.path.append(str(WORKERS))  # last: tests/workers/batch.py must not shadow support/batch.py
from offload_runs import config, run, working  # noqa: E402


@pytest.mark.parametrize("cfg,why", [
    ({"offload": {"delayed_update": True}}, "needs offload_optimizer = cpu"),
    ({"offload_optimizer": "cpu", "offload": {"delayed_update": True, "pipeline": "copy"}}, "staged pipeline"),
    ({"offload_optimizer": "cpu", "offload": {"delayed_update": True}}, "needs bf16 or fp16"),
    ({"offload_optimizer": "cpu", "precision": "bf16", "tensor_parallel_size": 2,
      "offload": {"delayed_update": True}}, "tensor_parallel_size 1"),
    ({"offload": {"pipeline": "fast"}}, "auto, staged or copy"),
    ({"offload": {"threads": 0}}, "integer >= 1"),
    ({"offload": {"host_pass": "numba"}}, "auto, compiled or torch"),
    ({"offload": {"delay": True}}, "unknown key"),
])
def test_offload_config_is_checked_naming_the_key(cfg, why):
    with pytest.raises(ConfigError, match=why) as e:
        zerompi.load_config(cfg)
    assert e.value.key.startswith("offload")


def test_staged_pipeline_on_the_cpu():
    """Default on the CPU is the copy pipeline; staged on request: the fused host pass,
    no fp32 gradient copy, staging in the parameter dtype, phases reported."""
    copy = zerompi.initialize(GPT(PRESETS["tiny"]), {"stage": 2, "precision": "bf16", "offload_optimizer": "cpu"})
    assert copy.offload is None and copy.state.host_grad is not None and copy.offload_phases == {}
    r = run(2, delayed=False)
    e = r["engine"]
    assert type(e.optimizer).__name__ == "HostPassAdamW" and e.state.host_grad is None
    assert [(g.dtype, o.dtype) for g, o in e.state.staging] == [(torch.bfloat16, torch.bfloat16)]
    ph = e.offload_phases
    assert ph["threads"] >= 1 and ph["grad_bytes"] == ph["param_bytes"] == 2 * e.state.owned
    assert ph["host_bytes"] == 28 * e.state.owned and ph["host_update"] > 0 and not ph["delayed"]
    rep = e.memory_report()
    assert rep["offloaded"] == (12 + 4) * e.state.owned


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_delayed_update_is_the_hand_delayed_run_bit_for_bit(stage):
    a = run(stage, delayed=True)
    b = run(stage, delayed=False, emulate=True)
    plain = run(stage, delayed=False)
    assert a["losses"] == b["losses"] and a["norms"] == b["norms"], (a["losses"], b["losses"])
    assert all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"])
    # the delay is real: from the second step on, the losses differ from the plain run's
    assert a["losses"][0] == plain["losses"][0] and a["losses"][2:] != plain["losses"][2:]
    assert a["engine"].offload_phases["delayed"]


def test_reading_the_state_does_not_change_a_delayed_run():
    """full_state_dict every step waits for the host pass but uploads nothing early."""
    a = run(2, delayed=True)
    b = run(2, delayed=True, read_every_step=True)
    assert a["losses"] == b["losses"]
    assert all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"])


def test_flush_and_loading_put_the_pending_update_on_the_device():
    r = run(1, delayed=True, steps=3)
    e = r["engine"]
    assert e.offload.pending is not None
    master = e.state.master.to(torch.bfloat16)
    # the device copy is one update behind the master until flushed
    assert not torch.equal(working(e)[:e.state.owned], master)
    e.offload.flush()
    assert e.offload.pending is None and torch.equal(working(e)[:e.state.owned], master)
    r = run(1, delayed=True, steps=3)
    e = r["engine"]
    e.load_full_state_dict(r["params"])  # replaces the state: the pending update goes first
    assert e.offload.pending is None
    assert torch.equal(working(e)[:e.state.owned], e.state.master.to(torch.bfloat16))


def test_compiled_and_torch_host_pass_follow_the_same_run():
    a = run(3, delayed=True, host_pass="compiled") if _compiles() else None
    b = run(3, delayed=True, host_pass="torch")
    assert b["engine"].offload_phases["kernel"] == "torch"
    if a is not None:
        for k in a["params"]:
            assert torch.allclose(a["params"][k], b["params"][k], rtol=1e-5, atol=1e-6), k


def _compiles() -> bool:
    from zerompi.optim import host_kernel

    return host_kernel.library() is not None


def test_a_dropped_delayed_engine_is_collected():
    engine = zerompi.initialize(GPT(PRESETS["tiny"]), config(2, True))
    x = torch.randint(0, 256, (2, 16))
    for _ in range(2):
        _, loss = engine(x, x)
        engine.backward(loss)
        engine.step()
    assert engine.offload.pending is not None
    refs = [weakref.ref(engine), weakref.ref(engine.offload), weakref.ref(engine.state)]
    del engine
    gc.collect()
    assert [r() for r in refs] == [None, None, None]


@pytest.mark.parametrize("stage", [2, 3])
def test_staged_and_delayed_on_the_gpu(cuda, stage):
    """The GPU's streams and events: the delayed run still equals the hand-delayed one bit
    for bit (a copy ordered wrongly would differ or vary), the copies are timed."""
    a = run(stage, delayed=True, device="cuda")
    b = run(stage, delayed=False, emulate=True, device="cuda")
    assert a["losses"] == b["losses"] and a["norms"] == b["norms"]
    assert all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"])
    torch.cuda.synchronize()  # phases never wait for the copies: let them finish
    ph = b["engine"].offload_phases
    assert ph["d2h_busy"] > 0 and ph["upload_busy"] > 0 and ph["kernel"] in ("compiled", "torch"), ph
    st = b["engine"].state
    assert all(t.is_pinned() for pair in st.staging for t in pair) and not st.master.is_pinned()


class _Stream:
    """Stands in for a torch.cuda.Stream: records what the copy path asks of it."""

    def __init__(self, log, name="side"):
        self.log, self.name, self.device = log, name, torch.device("cpu")

    def wait_stream(self, other):
        self.log.append(f"{self.name} waits {other.name}")

    def wait_event(self, ev):
        self.log.append(f"{self.name} waits event")

    def synchronize(self):
        self.log.append(f"host waits {self.name}")


class _Event:
    def __init__(self, enable_timing=False):
        self.recorded = False

    def record(self, stream=None):
        self.recorded = True

    def synchronize(self):
        assert self.recorded

    def query(self):
        return self.recorded

    def elapsed_time(self, other):
        return 2.0


def test_gpu_copy_path_with_stand_in_streams(monkeypatch):
    """The CUDA branch of offload_io.Transfers, run on host tensors with streams and events
    stood in: every gradient block lands at its shard offset after its stream waited for
    the training stream, every upload tile lands at its device offset, the training
    stream waits for both before it zeroes gradients or reads parameters, and a step's
    copies are timed."""
    from zerompi.zero import offload_io

    log = []
    training = _Stream(log, "training")
    monkeypatch.setattr(torch.cuda, "Stream", lambda dev: _Stream(log))
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda dev=None: training)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: __import__("contextlib").nullcontext())
    e = run(1, delayed=False, steps=1)["engine"]
    st = e.state
    monkeypatch.setattr(st, "placement", type("P", (), {"is_cuda": True, "device": torch.device("cpu")})())
    io = offload_io.Transfers(st, 700)
    io.d2h.name, io.h2d.name = "d2h", "h2d"
    st.flat_grad.copy_(torch.randn(st.flat_grad.numel()))
    staging = torch.zeros(st.owned, dtype=st.grad_dtype)
    for k in io.blocks:
        io.grad_block(k, staging)
    want = torch.cat([st.flat_grad[c.flat_lo:c.flat_hi] for c in sorted(st.own, key=lambda c: c.shard_lo)])
    assert torch.equal(staging, want) and log.count("d2h waits training") == len(io.blocks)
    io.grads_landed()
    io.release_grads()
    out = torch.randn(st.owned).to(st.param_dtype)
    for t in range(len(io.tiles)):
        io.upload(t, out)
    io.uploads_queued(0)
    io.slot_free(0)
    assert len(io.tiles) > 1 and log.count("h2d waits training") == 1
    assert log[-4:] == ["host waits d2h", "training waits d2h", "h2d waits training", "training waits event"]
    got = torch.cat([st.flat_param[c.flat_lo:c.flat_hi] for c in sorted(st.own, key=lambda c: c.shard_lo)])
    assert torch.equal(got, out)
    busy = offload_io.busy_seconds(io.take_events())
    assert busy == pytest.approx({"d2h": 2e-3 * len(io.blocks), "upload": 2e-3 * len(io.tiles)})


def test_one_rank_hands_every_block_to_the_staging_as_backward_completes_it():
    """Alone the reducer reduces nothing: in the boundary backward it hands each block to
    the staging when its last parameter's gradient is in (a parameter unused this step:
    at the end), so the staged run at GAS 2 follows the plain one (the host pass is the
    fused kernel's arithmetic; only the norm's summation order differs)."""
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.unused = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4), torch.nn.Linear(3, 3)

        def forward(self, x):
            return self.b(torch.relu(self.a(x))).square().mean()

    def train(offload: bool):
        torch.manual_seed(0)
        cfg = {"stage": 2, "precision": "bf16", "gradient_accumulation_steps": 2, "gradient_clipping": 0.5,
               "bucket_size": 64, "optimizer": {"lr": 1e-2, "implementation": "fused"}}
        if offload:
            cfg.update(offload_optimizer="cpu", offload={"pipeline": "staged"})
        e = zerompi.initialize(Net(), cfg)
        handed = []
        if offload:
            assert e.reducer.local and len(e.layout.blocks) > 3
            inner = e.reducer.block_done
            e.reducer.block_done = lambda k: (handed.append((k, e.micro_steps, e.reducer.streaming)), inner(k))
        g = torch.Generator().manual_seed(1)
        for _ in range(6):
            e.backward(e(torch.randn(5, 8, generator=g)))
            e.step()
        return e, handed

    plain, _ = train(False)
    staged, handed = train(True)
    nb = len(staged.layout.blocks)
    # every block once per update, in the boundary micro-steps (1, 3, 5) only
    assert sorted(h[:2] for h in handed) == sorted((k, m) for m in (1, 3, 5) for k in range(nb))
    # ... most of them during backward (not all at its end)
    assert sum(h[2] for h in handed) >= 3 * (nb - 1), handed
    a, b = plain.full_state_dict(), staged.full_state_dict()
    assert all(torch.allclose(a[k], b[k], rtol=1e-6, atol=1e-7) for k in a)
    assert not torch.equal(a["a.weight"], torch.zeros_like(a["a.weight"]))
