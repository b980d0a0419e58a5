"""The controller-side guard of conftest.py: a `--dist loadgroup` run whose workers sent
back no "@group" node id (pytest 9.2 with pytest-xdist 3.8) stops with one line instead
of splitting every group across the workers."""
import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest

spec = importlib.util.spec_from_file_location("suite_conftest", Path(__file__).resolve().parents[1] / "conftest.py")
conftest = importlib.util.module_from_spec(spec)
spec.loader.exec_module(conftest)


def node(dist: str):
    return SimpleNamespace(config=SimpleNamespace(getvalue=lambda name: dist if name == "dist" else None))


def test_a_worker_without_group_suffixes_stops_the_run():
    ids = ["tests/unit/test_a.py::test_x", "tests/multirank/test_b.py::test_y"]
    with pytest.raises(pytest.UsageError, match=r"does not apply xdist_group \(no '@group' on tests/multirank/test_b.py"):
        conftest.pytest_xdist_node_collection_finished(node("loadgroup"), ids)


def test_applied_groups_unit_only_selections_and_other_modes_pass():
    grouped = ["tests/unit/test_a.py::test_x", "tests/multirank/test_b.py::test_y@batch"]
    conftest.pytest_xdist_node_collection_finished(node("loadgroup"), grouped)
    conftest.pytest_xdist_node_collection_finished(node("loadgroup"), ["tests/unit/test_a.py::test_x"])
    conftest.pytest_xdist_node_collection_finished(node("load"), ["tests/multirank/test_b.py::test_y"])
