"""A checkpoint written by zerompi before the one-engine redesign (commit 7da8305,
tests/data/ckpt-v0.1: bf16, stage 2, N = 2, the `odd` model after 2 steps) still loads,
at other world sizes and stages, with every fp32 master value bitwise as saved."""
import pytest

from batch import batched, worker
from mpirun import DATA


# a copy: loading must not need write access, but never touch the fixture
@batched(lambda n, stage: worker(n, "legacy_ckpt", "load", "--dir", "{dir}/ckpt-v0.1", "--stage",
                                             str(stage), copy={"ckpt-v0.1": DATA / "ckpt-v0.1"}))
@pytest.mark.parametrize("n,stage", [(1, 0), (2, 1), (3, 3)])
def test_pre_redesign_checkpoint_loads(n, stage, result):
    r = result
    assert r["global_steps"] == 2
    assert r["client"]["made_by"].endswith("zerompi/__init__.py")
    assert r["names_equal"]
    assert r["bitwise"] and all(r["bitwise"].values()), [k for k, v in r["bitwise"].items() if not v]
    assert r["finite_after_step"]
