"""Every command in README.md and docs/*.md (fenced lines starting with `python -m
zerompi.`, `mpiexec`, `srun`, `sbatch`, `bash `) is checked, in process, in one of three
ways:
  (a) a test runs it: REGISTRY maps the command to that test file and the text in it that
      runs the command (checked to be there);
  (b) its block is marked `<!-- needs: gpu -->` or `<!-- needs: slurm -->` (the line
      before the fence; tests/README.md);
  (c) it parses: a `python -m zerompi.X` command's arguments through X's own argparse (or,
      for train, TrainConfig: every key known, every value valid; a config file that the
      doc names as an example and the repo lacks is left out), a `bash FILE` through
      `bash -n`.
Also: every backticked repository path in the docs exists; docs/reliability.md names each
test in the tier it says; every `X.md, "Heading"` pointer (docs, READMEs, Slurm templates,
configs, code comments) names a heading that exists."""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import io
import re
import shlex
import subprocess
from pathlib import Path

import pytest
from mpirun import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
STARTS = ("python -m zerompi.", "mpiexec", "srun", "sbatch", "bash ")
MARKERS = {"gpu", "slurm"}

# command (as written, comments dropped) -> (test file, the text in it that runs the command)
REGISTRY = {
    "bash install.sh": ("tests/system/test_first_hour.py", '"install.sh")'),
    "sbatch slurm/cpu.sbatch": ("tests/system/test_slurm_templates.py", "cpu.sbatch"),
    "bash benchmarks/gpu_acceptance.sh results/ --wheels /path/to/wheels":
        ("tests/system/test_gpu_acceptance.py", "gpu_acceptance.sh"),
}
# docs/quickstart.md's documents-to-Llama commands: the test holds them verbatim
for _line in ("python -m zerompi.prepare docs/ --field text --tokenizer llama/tokenizer.json --val_fraction 0.01 "
              "--out data/docs",
              "mpiexec -n 2 python -m zerompi.train --init_from llama --tokenizer llama/tokenizer.json --data data/docs "
              "--zero.stage 3 --max_steps 100 --run_dir runs/llama",
              "python -m zerompi.export runs/llama/checkpoints --hf exports/llama"):
    REGISTRY[_line] = ("tests/system/test_quickstart_llama.py", _line.split(" python ")[-1][:60])


def doc_commands(text: str) -> list[tuple[int, str, str | None]]:
    """(line, command, marker) for every command in the fenced blocks of `text`: lines
    joined over trailing backslashes, comments dropped, `a && b` split in two."""
    out, lines = [], text.splitlines()
    fence, marker, i = False, None, 0
    while i < len(lines):
        s = lines[i].strip()
        if s.startswith("```"):
            if not fence:
                prev = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
                m = re.fullmatch(r"<!--\s*needs:\s*(\w+)\s*-->", prev)
                marker = m.group(1) if m else None
                if marker and marker not in MARKERS:
                    raise ValueError(f"line {i}: unknown marker {marker!r} (one of {sorted(MARKERS)})")
            fence = not fence
            i += 1
            continue
        start = i
        bare = re.sub(r"^(\$ )?(\w+=\S* )*", "", s)  # a prompt, environment assignments
        if fence and bare.startswith(STARTS):
            cmd = s.removeprefix("$ ")
            while cmd.endswith("\\") and i + 1 < len(lines):
                i += 1
                cmd = cmd[:-1] + " " + lines[i].strip()
            words = shlex.split(cmd, comments=True)
            for part in " ".join(shlex.quote(w) if w != "&&" else w for w in words).split(" && "):
                out.append((start + 1, part.strip(), marker))
        i += 1
    return out


class _Parsed(Exception):
    pass


def _parse_only(module: str, args: list[str]) -> None:
    """X's own parser on `args`, stopping before X runs: argparse's SystemExit on an
    unknown option or a bad value, ValueError from TrainConfig."""
    if module == "train":
        from zerompi.trainer import config as tc
        pairs, i = [], 0  # `--key value` pairs; `key=value` stays one word
        while i < len(args):
            n = 2 if args[i].startswith("--") and "=" not in args[i] else 1
            pairs.append(args[i:i + n])
            i += n
        argv = []
        for pair in pairs:
            if pair[0] in ("--config", "--deepspeed_config"):  # a file the repo has, else an example name
                argv += [pair[0], str(ROOT / pair[1])] if (ROOT / pair[1]).is_file() else []
            elif pair[-1].startswith("path/to/"):  # a placeholder path: the key must exist, the path cannot
                if pair[0].lstrip("-") not in {f.name for f in dataclasses.fields(tc.TrainConfig)}:
                    raise ValueError(f"unknown key {pair[0]}")
            else:
                argv += pair
        tc.from_argv(argv)
        return
    mod = importlib.import_module(f"zerompi.{module}")
    original = argparse.ArgumentParser.parse_args

    def stop(self, a=None, namespace=None):
        original(self, a, namespace)
        raise _Parsed

    main = getattr(mod, "main", None) or importlib.import_module(f"zerompi.{module}.cli").main
    argparse.ArgumentParser.parse_args = stop
    try:
        with contextlib.redirect_stderr(io.StringIO()) as err:
            code = main(args)
    except _Parsed:
        return
    except SystemExit as e:
        raise ValueError(f"python -m zerompi.{module}: {err.getvalue().strip()}") from None
    finally:
        argparse.ArgumentParser.parse_args = original
    raise ValueError(f"python -m zerompi.{module} exited {code}: {err.getvalue().strip()}")


def check(cmd: str, marker: str | None) -> str | None:
    """None when `cmd` is covered; else why not."""
    if cmd in REGISTRY:
        test, text = REGISTRY[cmd]
        return None if text in (ROOT / test).read_text() else f"{test} does not contain {text!r}"
    if marker:
        return None
    words = [w.strip("[]") for w in shlex.split(cmd) if w not in ("...", "[", "]")]
    while "=" in words[0]:
        words = words[1:]
    if words[0] in ("mpiexec", "srun") and "python" in words:
        words = words[words.index("python"):]
    if words[:2] == ["python", "-m"] and words[2].startswith("zerompi."):
        try:
            _parse_only(words[2].split(".", 1)[1], words[3:])
        except (ValueError, ImportError) as e:
            return f"does not parse: {e}"
        return None
    if words[0] == "bash" and len(words) > 1:
        script = ROOT / words[1]
        if not script.is_file():
            return f"{words[1]} does not exist"
        res = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        return None if res.returncode == 0 else f"bash -n {words[1]}: {res.stderr.strip()}"
    return "not run by a test, not marked, not parsed"


def test_extraction_and_markers():
    text = ("x\n```bash\n$ mpiexec -n 2 python -m zerompi.train --config a.toml \\\n"
            "    --zero.stage 3   # a comment\nbash install.sh && X=1 python -m zerompi.plot runs/x\n```\n"
            "<!-- needs: slurm -->\n\n```\nsbatch x.sbatch\n```\n```python\nimport zerompi\n```\n")
    assert doc_commands(text) == [
        (3, "mpiexec -n 2 python -m zerompi.train --config a.toml --zero.stage 3", None),
        (5, "bash install.sh", None), (5, "X=1 python -m zerompi.plot runs/x", None),
        (10, "sbatch x.sbatch", "slurm")]
    with pytest.raises(ValueError, match="unknown marker"):
        doc_commands("<!-- needs: tpu -->\n```\nsrun x\n```\n")


def test_checker_fails_on_wrong_commands():
    assert check("python -m zerompi.estimate --table1", None) is None
    assert "does not parse" in check("python -m zerompi.estimate --tabel1", None)
    assert check("mpiexec -n 2 python -m zerompi.train --config configs/tiny.toml --zero.stage 3", None) is None
    assert "does not parse" in check("mpiexec -n 2 python -m zerompi.train --zero.stag 3", None)
    assert "does not parse" in check("python -m zerompi.train --zero.stage 7", None)
    assert check("python -m zerompi.train --config run.toml --init_from path/to/llama zero.stage=3", None) is None
    assert "unknown key --init_frm" in check("python -m zerompi.train --init_frm path/to/llama", None)
    assert "does not parse" in check("python -m zerompi.inspect ckpt --verfy", None)
    assert check("sbatch slurm/gpu.sbatch", None) == "not run by a test, not marked, not parsed"
    assert check("sbatch slurm/gpu.sbatch", "slurm") is None
    assert check("bash nowhere.sh", None) == "nowhere.sh does not exist"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_doc_command_is_covered(doc):
    bad = [f"{doc.name}:{n}: {cmd}: {why}" for n, cmd, marker in doc_commands(doc.read_text())
           if (why := check(cmd, marker))]
    assert bad == []


# Paths the docs name in backticks.

PATH = re.compile(r"`((?:[\w.-]+/)+[\w.*<>-]*)`")
# deleted studies, named beside the commit that holds them (docs/performance.md)
HISTORICAL = {"benchmarks/investigations/", "benchmarks/bench_pinned_alloc.py"}
TOPS = {"zerompi", "tests", "docs", "benchmarks", "slurm", "configs", "cuda_src", "scripts"}  # checked roots


def missing_paths(text: str, here: Path) -> list[str]:
    """Backticked repository paths (with a `/` or a known suffix) that do not exist, looked
    up from the repo root, from zerompi/ and from the doc's own folder; `*` and `<x>`
    are patterns (something must match)."""
    out = []
    for p in sorted(set(PATH.findall(text))):
        top = p.split("/", 1)[0]
        if p in HISTORICAL:
            continue
        if top not in TOPS | ({d.name for d in (ROOT / "zerompi").iterdir() if d.is_dir()} - {"data"}):
            continue  # a run's output, a user's path, a package path in prose
        pattern = re.sub(r"<[^>]*>", "*", p).rstrip("/")
        if not any(list(base.glob(pattern)) if "*" in pattern else (base / pattern).exists()
                   for base in (ROOT, ROOT / "zerompi", here)):
            out.append(p)
    return out


def test_path_checker(tmp_path):
    text = "`docs/`, `zero/engine.py`, `tests/unit/test_<x>.py`, `docs/nowhere.md`, `runs/x/metrics.jsonl`"
    assert missing_paths(text, tmp_path) == ["docs/nowhere.md"]


@pytest.mark.parametrize("doc", DOCS + sorted(ROOT.glob("*/README.md")), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_path_named_exists(doc):
    assert missing_paths(doc.read_text(), doc.parent) == []


# docs/reliability.md's tests, in the tier the page says.

DEFAULT_TESTS = ("tests/system/test_watchdog.py", "tests/system/test_reliability.py")


def reliability_problems(text: str, root: Path = ROOT) -> list[str]:
    """Test names that are not where the page puts them. A file with its tier
    (`tests/unit/test_x.py`) must be there; a bare `test_x.py` is in tests/system/ (the
    page's tier); a bare `test_f` is defined in the file named before it on its line, or
    else in one of DEFAULT_TESTS. `::test_f` and `[param]` are checked the same way."""
    out = []
    for line in text.splitlines():
        context = None
        for tok in re.findall(r"`([^`]*test_[^`]*)`", line):
            m = re.fullmatch(r"((?:tests/\w+/)?test_\w+\.py)?(?:::)?(test_\w+)?(\[[^\]]*\])?", tok)
            if not m or not (m.group(1) or m.group(2)):
                continue
            if m.group(1):
                context = m.group(1) if "/" in m.group(1) else f"tests/system/{m.group(1)}"
                if not (root / context).is_file():
                    out.append(f"{tok}: no {context}")
                    continue
            files = [context] if context else list(DEFAULT_TESTS)
            fn = m.group(2)
            if fn and not any(re.search(rf"^(async )?def {fn}\(", (root / f).read_text(), re.M)
                              for f in files if (root / f).is_file()):
                out.append(f"{tok}: not in {' or '.join(files)}")
    return out


def test_reliability_checker(tmp_path):
    for f, fn in [("tests/system/test_watchdog.py", "test_a"), ("tests/system/test_reliability.py", "test_b"),
                  ("tests/unit/test_u.py", "test_c"), ("tests/system/test_s.py", "test_d")]:
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / f).write_text(f"def {fn}():\n    pass\n")
    good = "| x | `test_a`, `test_b[async]`, `tests/unit/test_u.py::test_c`, `test_s.py`: `test_d` |"
    assert reliability_problems(good, tmp_path) == []
    assert reliability_problems("| `test_c` | `test_u.py` | `test_s.py::test_a` |", tmp_path) == [
        "test_c: not in tests/system/test_watchdog.py or tests/system/test_reliability.py",
        "test_u.py: no tests/system/test_u.py", "test_s.py::test_a: not in tests/system/test_s.py"]


def test_reliability_page_names_tests_in_their_tiers():
    assert reliability_problems((ROOT / "docs" / "reliability.md").read_text()) == []


# `some.md, "Heading"` pointers (docs, READMEs, Slurm templates, code comments) name a heading
# that exists (the start of it is enough).

POINTER = re.compile(r"((?:[\w./-]*/)?[\w-]+\.md|\bREADME)[`')]*,?\s+(?:section\s+)?\"([^\"\n]{3,80})\"")


def stale_pointers(text: str, here: Path, root: Path = ROOT) -> list[str]:
    out = []
    flat = re.sub(r"\n\s*#?\s*", " ", text)  # pointers wrapped over comment lines
    for doc, heading in POINTER.findall(flat):
        name = "README.md" if doc == "README" else doc  # a bare README: this folder's or the repo's
        targets = [c for c in (root / name, here / name, root / "docs" / name) if c.is_file()]
        if not targets:
            out.append(f"{doc}: no such file")
        elif not any(re.sub(r"^#+\s*", "", h).strip().startswith(heading)
                     for t in targets for h in t.read_text().splitlines() if h.startswith("#")):
            out.append(f'{doc}, "{heading}": no such heading')
    return out


def test_pointer_checker(tmp_path):
    (tmp_path / "a.md").write_text("# A\n## Not done yet (the list)\n")
    text = 'see a.md, "Not done yet"; (a.md,\n# "Moved away") and `b.md`, "Xyz" (README, "Gone")'
    (tmp_path / "README.md").write_text("# R\n")
    assert stale_pointers(text, tmp_path, tmp_path) == [
        'a.md, "Moved away": no such heading', "b.md: no such file", 'README, "Gone": no such heading']


def test_section_pointers_exist():
    files = [*DOCS, *ROOT.glob("*/README.md"), *(ROOT / "slurm").iterdir(), *(ROOT / "configs").iterdir(),
             *(ROOT / "zerompi").rglob("*.py"), *(ROOT / "tests").rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py")]
    bad = [f"{p.relative_to(ROOT)}: {s}" for p in files
           if p.is_file() and p.name != Path(__file__).name for s in stale_pointers(p.read_text(), p.parent)]
    assert bad == []
