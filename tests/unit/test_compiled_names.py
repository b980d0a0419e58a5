"""A whole model under `torch.compile` (a wrapper whose names start with `_orig_mod.`)
trains, saves and exports under the model's own names (zero/build.py unwrap_compiled):
at stages 1 and 3 its checkpoint names the same tensors as the uncompiled model's, a
checkpoint of either loads into the other, and the forward still runs compiled graphs.
One rank, in-process; backend "eager" (what is captured, not generated code)."""
import pytest
import torch

import zerompi
from zerompi.checkpoint import read_manifest
from zerompi.models.gpt import GPT, PRESETS


class Counting:
    """The eager backend, counting the calls of the graphs it compiled."""

    def __init__(self):
        self.calls = 0

    def __call__(self, gm, inputs):
        def counted(*args):
            self.calls += 1
            return gm.forward(*args)
        return counted


def _engine(stage: int, backend=None):
    torch.manual_seed(0)
    model = GPT(PRESETS["tiny"])
    if backend is not None:
        model = torch.compile(model, backend=backend)
    return zerompi.initialize(model, {"stage": stage, "optimizer": {"lr": 1e-2}})


def _step(engine, seed: int):
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(seed))
    _, loss = engine(x, x)
    engine.backward(loss)
    engine.step()
    return loss.item()


@pytest.mark.parametrize("stage", [1, 3])
def test_compiled_and_plain_checkpoints_have_the_same_names_and_load_into_each_other(stage, tmp_path):
    from zerompi.export_hf import hf_plan
    from zerompi.models.arch import record

    backend = Counting()
    plain, compiled = _engine(stage), _engine(stage, backend)
    names = [n for n, _ in GPT(PRESETS["tiny"]).named_parameters()]
    assert _step(plain, 1) == _step(compiled, 1)
    assert backend.calls > 0  # the forward ran compiled graphs
    assert list(compiled.full_state_dict()) == list(plain.full_state_dict()) == names
    model_record = {"model": record(PRESETS["tiny"])}  # what export --hf reads (the trainer saves it)
    for name, eng in (("plain", plain), ("compiled", compiled)):
        eng.save_checkpoint(tmp_path / name, tag="t", client_state=model_record)
    saved = {n: read_manifest(tmp_path / n / "t") for n in ("plain", "compiled")}
    assert sorted(saved["compiled"]["tensors"]) == sorted(saved["plain"]["tensors"]) == sorted(names)
    assert hf_plan(saved["compiled"], "fp32") == hf_plan(saved["plain"], "fp32")

    # across: a compiled run resumes a plain checkpoint and the other way round
    for src, dst in (("plain", _engine(stage, backend)), ("compiled", _engine(stage))):
        dst.load_checkpoint(tmp_path / src, tag="t")
        want = (plain if src == "plain" else compiled).full_state_dict()
        got = dst.full_state_dict()
        assert list(got) == names and all(torch.equal(got[n], want[n]) for n in names), src
        assert _step(dst, 2) == _step(plain if src == "plain" else compiled, 2), src


def test_a_compiled_models_state_dict_loads_by_its_own_names():
    """`torch.compile(model).state_dict()` keys start with `_orig_mod.`; the engine of a
    compiled model, named as the model, takes them (and a plain one's)."""
    torch.manual_seed(1)
    source = GPT(PRESETS["tiny"])
    wrapped = torch.compile(source, backend="eager").state_dict()
    assert all(k.startswith("_orig_mod.") for k in wrapped)
    for sd in (wrapped, source.state_dict()):
        engine = _engine(3, "eager")
        assert engine.load_full_state_dict(sd) == ([], [])
        got = engine.full_state_dict()
        assert all(torch.equal(got[n], p) for n, p in source.named_parameters())
