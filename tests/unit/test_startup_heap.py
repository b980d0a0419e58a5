"""`python -m zerompi.train` takes what its imports built out of the cyclic collector's
view (zerompi/runtime/pygc.py: ~0.4-0.5 CPU-s less per rank, measured) and runs no
collection while it imports (~0.15 CPU-s less); importing zerompi.train into a caller's
process freezes nothing of the caller's and leaves its collector as it was."""
import subprocess
import sys

from mpirun import mpi_env

PROBE = """
import gc, runpy, sys
import zerompi.train
print("frozen", gc.get_freeze_count())
sys.argv = ["zerompi.train", "--help"]
try:
    runpy.run_module("zerompi.train", run_name="__main__")  # as `python -m zerompi.train --help`
except SystemExit:
    pass
print("frozen", gc.get_freeze_count())
"""


def test_the_train_command_freezes_its_import_heap_and_an_import_does_not():
    r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=mpi_env(), timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    after_import, after_command = (line.split()[1] for line in r.stdout.splitlines() if line.startswith("frozen "))
    assert int(after_import) == 0
    assert int(after_command) > 50_000  # torch's modules and registries (~170k objects)


COUNT = """
import gc, runpy, sys
starts = []
gc.callbacks.append(lambda phase, info: phase == "start" and starts.append(info["generation"]))
if sys.argv[1] == "off":
    gc.disable()
sys.argv = ["zerompi.train", "--help"]
try:
    runpy.run_module("zerompi.train", run_name="__main__")
except SystemExit:
    pass
print("collections", len(starts), "enabled", gc.isenabled())
"""


def test_the_train_command_collects_nothing_while_it_imports_and_then_turns_the_collector_back_on():
    got = {}
    for state in ("on", "off"):
        r = subprocess.run([sys.executable, "-c", COUNT, state], capture_output=True, text=True, env=mpi_env(),
                           timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        line = next(x for x in r.stdout.splitlines() if x.startswith("collections ")).split()
        got[state] = (int(line[1]), line[3])
    # ~370 passes without the pause; what is left is zerompi's own package import (numpy)
    # before the command's first line, and --help itself
    assert got["on"][0] < 100 and got["on"][1] == "True", got
    assert got["off"] == (0, "False"), got  # a collector the caller turned off stays off
