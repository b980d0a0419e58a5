"""`python -m zerompi.train` agrees its config before it imports torch, then takes what its
imports built out of the cyclic collector's view (zerompi/runtime/pygc.py: ~0.4-0.5 CPU-s
less per rank, measured) and runs no collection while it imports torch (~0.15 CPU-s
less); importing zerompi.train into a caller's process imports no torch, freezes nothing
of the caller's and leaves its collector as it was.

One rank, no mpiexec (MPI's singleton start), one step of the tiny model."""
import subprocess
import sys

import numpy as np

from mpirun import mpi_env
from zerompi.data import write_tokens

PROBE = """
import gc, runpy, sys
data, run_dir, state = sys.argv[1:4]
before_freeze = []  # collections while nothing is frozen yet: the command's start-up
gc.callbacks.append(lambda phase, info: phase == "start" and not gc.get_freeze_count()
                    and before_freeze.append(info["generation"]))
if state == "off":
    gc.disable()
import zerompi.train
print("import", "torch" in sys.modules, gc.get_freeze_count())
sys.argv = ["zerompi.train", "--max_steps", "1", "--global_batch", "2", "--eval_interval", "0",
            "--data", data, "--run_dir", run_dir]
try:
    runpy.run_module("zerompi.train", run_name="__main__")  # as `python -m zerompi.train`
except SystemExit as e:
    print("exit", e.code)
print("command", gc.get_freeze_count(), len(before_freeze), gc.isenabled())
"""


def _probe(tmp_path, state: str) -> dict:
    data = tmp_path / "ids.bin"
    if not data.exists():
        write_tokens(data, np.random.default_rng(0).integers(0, 256, 20_000), vocab_size=256)
    r = subprocess.run([sys.executable, "-c", PROBE, str(data), str(tmp_path / f"run-{state}"), state],
                       capture_output=True, text=True, env=mpi_env(), timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return {line.split()[0]: line.split()[1:] for line in r.stdout.splitlines()
            if line.split() and line.split()[0] in ("import", "exit", "command")}


def test_the_train_command_imports_torch_late_freezes_its_heap_and_collects_nothing_meanwhile(tmp_path):
    got = _probe(tmp_path, "on")
    assert got["import"] == ["False", "0"], got  # a plain import: no torch, nothing frozen
    assert got["exit"] == ["0"], got
    frozen, collections, enabled = got["command"]
    assert int(frozen) > 50_000, got  # torch's modules and registries (~170k objects)
    # ~370 passes while torch imports without the pause; what is left is the command's
    # own start (config, MPI) before it
    assert int(collections) < 60 and enabled == "True", got


def test_a_collector_the_caller_turned_off_stays_off(tmp_path):
    got = _probe(tmp_path, "off")
    assert got["exit"] == ["0"] and got["command"][1:] == ["0", "False"], got
