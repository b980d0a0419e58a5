"""`python -m zerompi.train` takes what its imports built out of the cyclic collector's
view (zerompi/runtime/pygc.py: ~0.4-0.5 CPU-s less per rank, measured); importing
zerompi.train into a caller's process freezes nothing of the caller's."""
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
