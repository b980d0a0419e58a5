"""docs/architecture.md, "Where each concern lives", against the code: the layer picture
holds every first-level package/module and every import between packages points down (or
sideways); the module table names every module and only paths that exist. README's module
table names every first-level package/module too."""
from __future__ import annotations

import re
from pathlib import Path

from mpirun import ROOT
from test_house import import_graph, package_graph

PKG = ROOT / "zerompi"
DOC = ROOT / "docs" / "architecture.md"
SECTION = "Where each concern lives"
UNPICTURED = {"version"}  # a version string, imported by whoever needs it


def section(text: str, heading: str) -> str:
    """The text under `## heading` up to the next `## ` heading."""
    m = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    if not m:
        raise AssertionError(f"no section '## {heading}'")
    return m.group(1)


def picture_layers(sec: str) -> list[list[str]]:
    """The first fenced block's layers, top first: each line that names `x/` or `x.py`
    (parenthesised remarks ignored) is one layer; lines of `|` only join them."""
    m = re.search(r"^```\w*\n(.*?)^```", sec, re.S | re.M)
    if not m:
        raise AssertionError("no layer picture (fenced block) in the section")
    layers = []
    for line in m.group(1).splitlines():
        line = re.sub(r"\([^)]*\)", "", line)
        names = [a for a, _ in re.findall(r"(?<![\w./])([a-z_][a-z0-9_]*)(/|\.py)(?![\w/])", line)]
        if names:
            layers.append(names)
    return layers


def layer_problems(layers: list[list[str]], tops: set[str], edges: dict[str, set[str]]) -> list[str]:
    """What the picture gets wrong: a first-level name missing or unknown or drawn twice,
    and an import edge (a -> b, both first-level names) from a lower layer to a higher."""
    where: dict[str, int] = {}
    out = []
    for i, names in enumerate(layers):
        for n in names:
            if n in where:
                out.append(f"{n} drawn twice")
            where[n] = i
    out += [f"{n} not in the picture" for n in sorted(tops - set(where) - UNPICTURED)]
    out += [f"{n} drawn but not a zerompi package/module" for n in sorted(set(where) - tops)]
    for a, bs in sorted(edges.items()):
        for b in sorted(bs):
            if a in where and b in where and where[a] > where[b]:
                out.append(f"{a} imports {b}, drawn above it")
    return out


def table_rows(sec: str) -> list[tuple[list[str], str]]:
    """(paths in the first cell, the whole row) of the section's module table."""
    rows = []
    for line in sec.splitlines():
        if not line.startswith("| `"):
            continue
        first = line.split("|")[1]
        rows.append((re.findall(r"`([^`]+)`", first), line))
    return rows


def _pathlike(tok: str) -> bool:
    return bool(re.fullmatch(r"[\w./-]+", tok)) and (tok.endswith(".py") or tok.endswith("/"))


def table_problems(rows: list[tuple[list[str], str]], modules: list[str], pkg: Path) -> list[str]:
    """Modules (paths relative to `pkg`) the table does not name, and paths it names that
    do not exist. A module is named by its path in a first cell, or by its file name (or
    a path below the package) anywhere in the row of its package (`config/`)."""
    named: set[str] = set()
    out = []
    for firsts, row in rows:
        dirs = [f for f in firsts if f.endswith("/")]
        for f in firsts:
            if _pathlike(f):
                if not ((pkg / f).exists() or (pkg.parent / f).exists()):
                    out.append(f"table names {f}, which does not exist")
                named.add(f)
        for tok in re.findall(r"`([^`]+)`", row.split("|", 2)[2]):
            if not _pathlike(tok) or tok in firsts:
                continue
            hits = [d + tok for d in dirs if (pkg / d / tok).exists()]
            if (pkg / tok).exists():
                hits.append(tok)
            if not hits and not (pkg.parent / tok).exists():
                out.append(f"table names {tok} (row {firsts[0] if firsts else '?'}), which does not exist")
            named.update(hits)
    out += [f"{m} not in the table" for m in modules if m not in named]
    return out


def code_modules(pkg: Path = PKG) -> list[str]:
    """Every module path below `pkg`, except packages' __init__ and private/dunder files."""
    return sorted(str(p.relative_to(pkg)) for p in pkg.rglob("*.py") if not p.name.startswith("_"))


def first_level(pkg: Path = PKG) -> set[str]:
    return {p.stem for p in pkg.iterdir()
            if (p.suffix == ".py" and not p.name.startswith("_")) or (p.is_dir() and (p / "__init__.py").exists())}


def first_level_edges() -> dict[str, set[str]]:
    short = lambda m: m.split(".", 1)[1]  # noqa: E731
    return {short(a): {short(b) for b in bs} for a, bs in package_graph(import_graph()).items()}


# The checkers on small inputs: each must fail on what it exists to catch.

SYNTH = """## Where each concern lives

```
train.py     (commands)
   |
zero/  (engine)
   |
comm/  config/
```

| package / module | concern |
|---|---|
| `zero/` | `engine.py`: the engine |
| `comm/base.py` | the protocol |
| `config/` | `zero.py`: the config |
| `train.py` | the command |

## Next
"""


def _synth_pkg(tmp_path: Path) -> Path:
    pkg = tmp_path / "zerompi"
    for f in ("train.py", "zero/__init__.py", "zero/engine.py", "comm/__init__.py", "comm/base.py",
              "config/__init__.py", "config/zero.py"):
        (pkg / f).parent.mkdir(parents=True, exist_ok=True)
        (pkg / f).write_text("")
    return pkg


def test_layer_checker_catches_missing_and_upward(tmp_path):
    pkg = _synth_pkg(tmp_path)
    layers = picture_layers(section(SYNTH, SECTION))
    assert layers == [["train"], ["zero"], ["comm", "config"]]
    edges = {"train": {"zero"}, "zero": {"comm", "config"}, "comm": {"config"}}
    assert layer_problems(layers, first_level(pkg), edges) == []
    assert layer_problems(layers, first_level(pkg) | {"data"}, edges) == ["data not in the picture"]
    # the drift the issue found: checkpoint drawn above zero, which imports it
    wrong = [["train"], ["checkpoint"], ["zero"], ["comm", "config"]]
    assert layer_problems(wrong, first_level(pkg) | {"checkpoint"}, {"zero": {"checkpoint"}}) == \
        ["zero imports checkpoint, drawn above it"]


def test_table_checker_catches_missing_and_unknown(tmp_path):
    pkg = _synth_pkg(tmp_path)
    rows = table_rows(section(SYNTH, SECTION))
    assert table_problems(rows, code_modules(pkg), pkg) == []
    (pkg / "zero" / "calls.py").write_text("")
    assert table_problems(rows, code_modules(pkg), pkg) == ["zero/calls.py not in the table"]
    (pkg / "zero" / "calls.py").unlink()
    (pkg / "comm" / "base.py").rename(pkg / "comm" / "mpi.py")
    assert table_problems(rows, code_modules(pkg), pkg) == [
        "table names comm/base.py, which does not exist", "comm/mpi.py not in the table"]


# The real document.

def test_picture_matches_the_imports():
    layers = picture_layers(section(DOC.read_text(), SECTION))
    assert layer_problems(layers, first_level(), first_level_edges()) == []


def test_table_names_every_module():
    rows = table_rows(section(DOC.read_text(), SECTION))
    assert table_problems(rows, code_modules(), PKG) == []


def test_readme_table_names_every_first_level_package():
    table = "\n".join(line for line in (ROOT / "README.md").read_text().split("\n## ", 1)[0].splitlines()
                      if line.startswith("| `"))
    names = {a for a, _ in re.findall(r"`(?:zerompi/)?([a-z_][a-z0-9_]*)(/|\.py)`", table)}
    assert sorted(first_level() - UNPICTURED - names) == []
