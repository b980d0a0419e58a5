"""How tests/support/batch.py plans a session's batched cases, without launching: every
selected test's cases once, what a case needs before it, the longest timeout asked for
an equal case, nothing of tests skipped at collection, only the cases of the asking
test's xdist group (one for every batched test); and the order the workers take the
groups in (conftest.py)."""
import types

import pytest

from batch import Batches, Case, batched, cases_of, group_name, size_of, worker


class Item:
    """The part of a pytest item the planner reads."""

    def __init__(self, make, params=None, marks=(), group=None):
        self.callspec = types.SimpleNamespace(params=params) if params is not None else None
        self.marks = [batched(make).mark] + [m.mark for m in marks]
        if group is not None:
            self.marks.append(pytest.mark.xdist_group(group).mark)

    def get_closest_marker(self, name):
        return next((m for m in self.marks if m.name == name), None)

    def iter_markers(self, name):
        return (m for m in self.marks if m.name == name)


def test_plan_deduplicates_orders_needs_first_and_leaves_skipped_tests_out(tmp_path):
    save = worker(4, "tp_parity", "--save", "{tmp}/ck", timeout=400)
    load = worker(3, "tp_parity", "--load", "{tmp}/ck", needs=(save,))
    items = [Item(lambda n: worker(n, "parity", "--model", "odd", timeout=50), params={"n": 2, "other": 1}),
             Item(lambda: (load, worker(2, "parity", "--model", "odd"))),
             Item(lambda: worker(2, "never"), marks=[pytest.mark.skipif(True, reason="x")]),
             Item(lambda: worker(2, "never"), marks=[pytest.mark.skip(reason="x")])]
    b = Batches(types.SimpleNamespace(items=items), tmp_path)
    odd = worker(2, "parity", "--model", "odd")
    assert b._plan(None) == [odd, save, load]
    assert b.timeouts == {odd: 180, save: 400, load: 180}  # equal cases: the longest timeout
    assert cases_of(items[1]) == (load, odd) and cases_of(items[2]) is None


def test_case_names_and_equality():
    c = worker(2, "device_bind", "--x", "a b", env={"V": "1"}, timeout=5)
    assert c.name == "V=1 n2 device_bind --x 'a b'"
    assert c == Case(2, "device_bind", ("--x", "a b"), (("V", "1"),))  # the timeout is not the case
    assert c != worker(3, "device_bind", "--x", "a b", env={"V": "1"})
    assert worker(1, "w", copy={"d": "/src"}).copy == (("d", "/src"),)


def test_plan_per_group_and_group_names():
    """A worker plans only its group's cases (another worker runs the others); every
    batched test is in one group, whatever sizes its cases span."""
    save = worker(4, "tp_parity", "--save", "{tmp}/ck")
    load = worker(3, "tp_parity", "--load", "{tmp}/ck", needs=(save,))
    odd = worker(3, "parity", "--model", "odd")
    assert group_name(load) == group_name((odd, save)) == group_name(odd) == "batch"
    items = [Item(lambda: odd, group="g1"), Item(lambda: load, group="g2")]
    b = Batches(types.SimpleNamespace(items=items), None)
    assert b._plan("g1") == [odd]
    assert b._plan("g2") == [save, load]
    assert [size_of(i) for i in items] == [3, 4]  # the largest size, needs included


def test_worker_order_puts_the_launches_and_the_waiting_groups_first():
    """conftest.HEAD first, in its order, the batch group's tests largest world size first
    (a smaller launch then finds what a larger one saved for it); then the other groups,
    most tests first; a group's tests keep their order and stay together; ungrouped tests
    keep theirs."""
    from types import SimpleNamespace

    from conftest import HEAD, _worker_order

    def item(nodeid, group=None, n=None):
        marks = {"xdist_group": SimpleNamespace(args=(group,)) if group else None}
        if n is not None:
            marks["batched"] = batched(lambda: worker(n, "w")).mark
        return SimpleNamespace(nodeid=nodeid, get_closest_marker=lambda name, m=marks: m.get(name),
                               iter_markers=lambda name: iter(()), callspec=None)

    items = [item("u1"), item("a1", "files/a"), item("n1", "netns"), item("b1", "files/b"), item("s1", "slurm"),
             item("b2", "files/b"), item("u2"), item("c2", "batch", 2), item("s2", "slurm"), item("a2", "files/a"),
             item("c4", "batch", 4), item("b3", "files/b"), item("c1", "batch", 1), item("c4b", "batch", 4)]
    got = [i.nodeid for i in _worker_order(items)]
    assert HEAD == ("batch", "slurm", "netns")
    assert got == ["c4", "c4b", "c2", "c1", "s1", "s2", "n1", "b1", "b2", "b3", "a1", "a2", "u1", "u2"]


def test_a_unit_files_module_fixture_keeps_its_tests_on_one_worker():
    """Tests that use a module-scoped fixture of their own file share an xdist group (the
    fixture is built once); a module fixture of another file, or a function-scoped one,
    leaves an in-process test free to go to either worker."""
    from types import SimpleNamespace

    from conftest import _xdist_group

    def item(scope, baseid):
        defs = {"f": [SimpleNamespace(scope=scope, baseid=baseid)]}
        return SimpleNamespace(nodeid="tests/unit/test_x.py::test_a", fixturenames=["f"],
                               _fixtureinfo=SimpleNamespace(name2fixturedefs=defs))

    rel = ("unit", "test_x.py")
    assert _xdist_group(item("module", "tests/unit/test_x.py"), rel) == "unit/test_x.py"
    assert _xdist_group(item("module", "tests/unit/test_y.py"), rel) is None
    assert _xdist_group(item("function", "tests/unit/test_x.py"), rel) is None
    assert _xdist_group(item("module", "tests/multirank/test_x.py"), ("multirank", "test_x.py")) == "multirank/test_x.py"
