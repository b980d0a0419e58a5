"""Offline install (issue 24): `install.sh --wheelhouse DIR` and scripts/mpi_from_wheels.sh
from a local folder of wheels, run in a fresh network namespace that has only a
loopback interface, so any attempt to reach an index fails. The wheels are fetched
beforehand, outside the namespace (pip download; skips where that is impossible)."""
from __future__ import annotations

import ast
import json
import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Runs inside the namespace before anything else: an outside address must be unreachable.
NO_NET = ("ip link set lo up && ! python -c \"import socket; socket.create_connection(('198.51.100.7', 443), "
          "timeout=3)\" 2>/dev/null")
# Each rank reports the MPI library it mapped and the zerompi it imported.
RANKS = ("import json, zerompi; from mpi4py import MPI; "
         "libs = sorted({l.split()[-1] for l in open('/proc/self/maps') if 'libmpi.so' in l}); "
         "import sys; sys.stdout.write(json.dumps({'sum': MPI.COMM_WORLD.allreduce(1), 'libs': libs, "
         "'zerompi': zerompi.__file__}) + chr(10))")  # one write per rank: print's parts interleave


def _offline(script: str, env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    if shutil.which("unshare") is None or subprocess.run(["unshare", "--net", "true"]).returncode:
        pytest.skip("cannot make a network namespace here (needs unshare and root)")
    return subprocess.run(["unshare", "--net", "bash", "-c", f"set -e; {NO_NET}; {script}"], env=env,
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("wheels")
    r = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(d),
                        "mpich==5.0.2", "mpi4py==4.1.2"], capture_output=True, text=True, timeout=300)
    if r.returncode:
        pytest.skip(f"cannot fetch the mpich/mpi4py wheels: {r.stderr[-300:]}")
    return d


def _venv_seeing_this_one(venv: Path) -> None:
    """A venv that sees the packages of the Python running this test (torch, numpy).
    `--system-site-packages` gives it the base interpreter's, which inside a virtualenv
    (`bash tests/run.sh` in a fresh venv) are not this environment's: a .pth file adds
    this environment's site-packages after the new venv's own, which still win."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(venv)], check=True)
    ours = site.getsitepackages() + ([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])
    new_site = next((venv / "lib").glob("python3*/site-packages"))
    (new_site / "zz_running_env.pth").write_text("".join(f"{d}\n" for d in ours))


def _env(venv: Path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update({"PATH": f"{venv}/bin:{env['PATH']}", "UCX_NET_DEVICES": "lo", "OMP_NUM_THREADS": "1", **extra})
    return env


def _ranks(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def test_install_sh_wheelhouse_offline_into_a_fresh_venv(wheels, tmp_path):
    """torch kept, MPICH from the folder under the venv's prefix (mpi4py could not load
    an MPI: MPI4PY_LIBMPI points nowhere), zerompi editable; 2 ranks run offline."""
    venv = tmp_path / "venv"
    _venv_seeing_this_one(venv)
    r = _offline(f"bash install.sh --wheelhouse {wheels} && source {venv}/zerompi-mpi.env && "
                 f"mpiexec -n 2 python -c \"{RANKS}\"",
                 _env(venv, MPI4PY_LIBMPI="/nonexistent/libmpi.so.12"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "offline: installing only from" in r.stdout and "keeping it" in r.stdout, r.stdout
    ranks = _ranks(r.stdout)
    assert len(ranks) == 2 and all(x["sum"] == 2 for x in ranks), r.stdout
    assert all(x["libs"] == [f"{venv}/lib/libmpi.so.12"] for x in ranks), ranks
    assert all(x["zerompi"].startswith(str(ROOT / "zerompi")) for x in ranks), ranks
    assert (venv / "bin" / "mpiexec").exists()


def test_wheelhouse_is_the_only_source(wheels, tmp_path):
    """An empty folder fails, naming the missing wheel, although PIP_FIND_LINKS (and this
    machine's pip.conf) point at folders that hold it."""
    venv, empty = tmp_path / "venv", tmp_path / "empty"
    empty.mkdir()
    _venv_seeing_this_one(venv)
    r = _offline(f"ZEROMPI_WHEELHOUSE={empty} bash install.sh",
                 _env(venv, MPI4PY_LIBMPI="/nonexistent/libmpi.so.12", PIP_FIND_LINKS=str(wheels)))
    assert r.returncode != 0
    assert f"no usable mpich wheel in {empty}" in r.stderr, r.stdout + r.stderr
    assert not (venv / "lib" / "libmpi.so.12").exists()


def test_mpi_from_wheels_for_a_python_without_mpi4py(wheels, tmp_path):
    """The GPU machine's case, harder: a Python with neither MPI nor mpi4py; both go under
    a separate prefix, and the env file is all a shell needs."""
    venv, prefix = tmp_path / "plain", tmp_path / "mpi"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    # one write per rank: print(a, b) writes its parts apart, and two ranks' parts interleave
    check = ("import sys; from mpi4py import MPI; "
             "sys.stdout.write(f'{MPI.COMM_WORLD.allreduce(1)} {MPI.Get_library_version().split()[0]}\\n')")
    r = _offline(f"PYTHON={venv}/bin/python bash scripts/mpi_from_wheels.sh {wheels} {prefix} && "
                 f"source {prefix}/zerompi-mpi.env && mpiexec -n 2 {venv}/bin/python -c \"{check}\"", _env(venv))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stdout.count("2 MPICH") == 2, r.stdout
    env = (prefix / "zerompi-mpi.env").read_text()
    assert f'MPI4PY_LIBMPI="{prefix}/lib/libmpi.so.12"' in env and "PYTHONPATH" in env, env


def test_cuda_extras_cover_cuda_12_and_13():
    tree = ast.parse((ROOT / "setup.py").read_text())
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
    extras = ast.literal_eval(next(k.value for k in call.keywords if k.arg == "extras_require"))
    for v in ("12", "13"):
        names = [r.split(">")[0].split("=")[0] for r in extras[f"cuda{v}"]]
        assert sorted(names) == [f"cupy-cuda{v}x", f"nvidia-nccl-cu{v}"], extras
    assert extras["cuda"] == extras["cuda12"]
