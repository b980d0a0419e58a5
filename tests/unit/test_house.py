"""House rules that keep the code navigable: no import cycle in zerompi/ (function-level
imports included, between modules and between packages), no file over 400 lines, and no
private name used outside the module that defines it."""
from __future__ import annotations

import ast
import collections
from pathlib import Path

from mpirun import ROOT

PKG = ROOT / "zerompi"
MAX_LINES = 400


def _modules(pkg: Path = PKG) -> dict[str, Path]:
    out = {}
    for p in pkg.rglob("*.py"):
        parts = p.relative_to(pkg.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def _targets(mod: str, is_pkg: bool, node, mods: dict) -> list[str]:
    """The zerompi modules an import statement names (the deepest existing module)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = mod if is_pkg else mod.rsplit(".", 1)[0]
        if node.level:
            base = ".".join(base.split(".")[:len(base.split(".")) - node.level + 1])
            tgt = base + ("." + node.module if node.module else "")
        else:
            tgt = node.module or ""
        names = [f"{tgt}.{a.name}" if f"{tgt}.{a.name}" in mods else tgt for a in node.names]
    out = []
    for t in names:
        while t and t not in mods:
            t = t.rpartition(".")[0]
        if t.startswith("zerompi"):
            out.append(t)
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> modules it imports anywhere in its source (function bodies too)."""
    mods = _modules()
    edges: dict[str, set[str]] = collections.defaultdict(set)
    for m, p in mods.items():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                edges[m].update(t for t in _targets(m, p.name == "__init__.py", node, mods) if t != m)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan, iterative)."""
    index, low, on, stack, out, n = {}, {}, set(), [], [], 0
    for root in sorted(set(edges) | {b for bs in edges.values() for b in bs}):
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = n
        n += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        x = stack.pop()
                        on.discard(x)
                        comp.append(x)
                        if x == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
            elif w not in index:
                index[w] = low[w] = n
                n += 1
                stack.append(w)
                on.add(w)
                work.append((w, iter(sorted(edges.get(w, ())))))
            elif w in on:
                low[v] = min(low[v], index[w])
    return out


def package_graph(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    """Edges between zerompi's first-level packages/modules. The top-level package
    (`import zerompi`: lazy entry points) is left out: it imports everything by design."""
    top = lambda m: ".".join(m.split(".")[:2])  # noqa: E731
    out: dict[str, set[str]] = collections.defaultdict(set)
    for a, bs in edges.items():
        for b in bs:
            if "zerompi" not in (a, b) and top(a) != top(b):
                out[top(a)].add(top(b))
    return out


def test_the_cycle_finder_finds_cycles():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(g) == [["a", "b", "c"]]
    assert package_graph({"zerompi.zero.x": {"zerompi.comm.y"}, "zerompi.comm.y": {"zerompi.zero.z"}}) == \
        {"zerompi.zero": {"zerompi.comm"}, "zerompi.comm": {"zerompi.zero"}}


def test_no_import_cycles_between_modules():
    assert cycles(import_graph()) == []


def test_no_import_cycles_between_packages():
    assert cycles(package_graph(import_graph())) == []


def test_no_file_over_400_lines():
    tracked = [p for p in ROOT.rglob("*.py") if not any(s.startswith(".") or s in ("build", "runs")
                                                         for s in p.relative_to(ROOT).parts)]
    long = {str(p.relative_to(ROOT)): n for p in tracked if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def private_uses(pkg: Path = PKG) -> list[str]:
    """`from M import _x` and `N._x` (N a name imported from zerompi) outside module M. A
    private *module* (`kernels/_loader.py`) may be imported within its own package."""
    mods, out = _modules(pkg), []
    for m, p in mods.items():
        imported: set[str] = set()
        tree = ast.parse(p.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                for tgt, alias in zip(_targets(m, p.name == "__init__.py", node, mods), node.names):
                    name = alias.name
                    imported.add(alias.asname or name)
                    if not name.startswith("_") or name.startswith("__") or tgt == m:
                        continue
                    if tgt.endswith("." + name):  # a private module: fine inside its package
                        package = tgt.rpartition(".")[0]
                        if m != package and not m.startswith(package + "."):
                            out.append(f"{m} imports {tgt}")
                    else:
                        out.append(f"{m} imports {tgt}.{name}")
            elif isinstance(node, ast.Import):
                imported.update((a.asname or a.name).split(".")[0] for a in node.names if a.name.startswith("zerompi"))
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in imported
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                out.append(f"{m} uses {node.value.id}.{node.attr}")
    return sorted(set(out))


def test_private_use_finder_finds_them(tmp_path):
    pkg = tmp_path / "zerompi"
    (pkg / "a").mkdir(parents=True)
    for f, text in {"__init__.py": "", "a/__init__.py": "", "a/_inner.py": "x = 1",
                    "a/b.py": "from . import _inner\nfrom .c import _hidden\n", "a/c.py": "_hidden = 1",
                    "d.py": "from .a import _inner\nfrom .a.c import C\nC._state\n"}.items():
        (pkg / f).write_text(text)
    assert private_uses(pkg) == ["zerompi.a.b imports zerompi.a.c._hidden", "zerompi.d imports zerompi.a._inner",
                              "zerompi.d uses C._state"]


def test_no_private_name_used_across_modules():
    assert private_uses() == []
