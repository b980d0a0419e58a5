"""The one seam between the engine and zerompi/checkpoint/ (zerompi/zero/checkpoint_view.py):
the checkpoint package reads and sets an engine only through the names its view declares.

Every function of checkpoint/ names its engine-like argument `engine` (the public entry
points, which take the view at once by engine.checkpoint_view()) or `view`; the scan
below finds every attribute read on those names, and every getattr/setattr/hasattr on
them, and refuses what the view does not declare."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

PKG = Path(__file__).resolve().parents[2] / "zerompi" / "checkpoint"


def seam_uses(pkg: Path) -> list[str]:
    """'file:line engine.X' / 'view.X' for each use outside the view's declared names."""
    from zerompi.zero.checkpoint_view import NAMES

    bad = []
    for f in sorted(pkg.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                who, attr = node.value.id, node.attr
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                  and node.func.id in ("getattr", "setattr", "hasattr", "delattr") and node.args
                  and isinstance(node.args[0], ast.Name)):
                who = node.args[0].id
                attr = node.args[1].value if len(node.args) > 1 and isinstance(node.args[1], ast.Constant) else "?"
            else:
                continue
            if who == "engine" and attr != "checkpoint_view" or who == "view" and attr not in NAMES:
                bad.append(f"{f.relative_to(pkg.parent)}:{node.lineno} {who}.{attr}")
    return bad


def test_checkpoint_uses_only_the_view():
    assert seam_uses(PKG) == []


def test_the_scan_finds_engine_attributes(tmp_path):
    (tmp_path / "m.py").write_text("def f(engine, view):\n    engine.dims\n    view.dims\n    view._async_saver = 1\n"
                                   "    getattr(engine, '_async_saver', None)\n    engine.checkpoint_view()\n")
    assert seam_uses(tmp_path) == [f"{tmp_path.name}/m.py:2 engine.dims", f"{tmp_path.name}/m.py:4 view._async_saver",
                                   f"{tmp_path.name}/m.py:5 engine._async_saver"]


def test_every_declared_name_exists_on_the_view():
    import zerompi
    from zerompi.zero.checkpoint_view import NAMES

    eng = zerompi.initialize(torch.nn.Linear(4, 3), {"stage": 1})
    view = eng.checkpoint_view()
    assert view is eng.checkpoint_view() and view.checkpoint_view() is view
    for name in sorted(NAMES):
        assert hasattr(view, name), name
    assert view.state_kinds == ("param", "exp_avg", "exp_avg_sq") and view.global_steps == 0
    assert view.saver is None and not hasattr(eng, "_async_saver") and not hasattr(eng, "_state_fence")


def test_the_fence_is_taken_once_before_the_next_update():
    import zerompi

    eng = zerompi.initialize(torch.nn.Linear(4, 3), {"stage": 2})
    calls = []
    eng.checkpoint_view().set_fence(lambda: calls.append(1))
    eng.backward(eng(torch.ones(2, 4)).sum())
    eng.step()
    eng.backward(eng(torch.ones(2, 4)).sum())
    eng.step()
    assert calls == [1]


def test_a_view_outliving_its_engine_says_so():
    import gc

    import zerompi

    eng = zerompi.initialize(torch.nn.Linear(4, 3), {"stage": 0})
    view = eng.checkpoint_view()
    del eng
    gc.collect()
    with pytest.raises(ReferenceError, match="engine of this checkpoint view is gone"):
        view.dims
