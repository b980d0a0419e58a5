#!/usr/bin/env bash
# The test command of the README (and of .ci/run): installs everything the suite needs on
# a fresh machine, then runs it. Safe to re-run: every step skips what is already there.
#   bash tests/run.sh            every tier (tests/README.md)
#   bash tests/run.sh --quick    the in-process tier only: no mpiexec, Slurm or end-to-end jobs
# Further arguments go to pytest (e.g. -k parity, -x, tests/multirank/test_parity.py).
set -euo pipefail
cd "$(dirname "$0")/.."

quick=0
if [ "${1:-}" = "--quick" ]; then
    quick=1
    shift
fi

# torch first, pinned: an unpinned torch would pull the newest CUDA build (several GB).
# pip takes ~8 s even when nothing is to do, so it runs only when the check below fails:
# this checkout is not the editable install, setup.py is newer than it, or a requirement
# of ".[mpich,test]" or the torch pin is not met.
TORCH_PIN=2.13.0
deps_met() {
    python -I - "$PWD" "$TORCH_PIN" <<'PY' 2>/dev/null
import importlib.metadata as md, json, os, sys
from packaging.requirements import Requirement
root, pin, d = sys.argv[1], sys.argv[2], md.distribution("zerompi")
assert json.loads(d.read_text("direct_url.json")).get("url") == "file://" + root
meta = next(d.locate_file(f) for f in d.files if f.name == "METADATA")
assert os.path.getmtime(os.path.join(root, "setup.py")) <= os.path.getmtime(meta)
for r in map(Requirement, d.requires):
    if r.marker is None or any(r.marker.evaluate({"extra": e}) for e in ("mpich", "test")):
        assert r.specifier.contains(md.version(r.name), prereleases=True), r
assert md.version("torch").split("+")[0] == pin
PY
}
if ! deps_met; then
    python -m pip install -q "torch==$TORCH_PIN"
    python -m pip install -q -e ".[mpich,test]"
fi
export OMP_NUM_THREADS=1 UCX_NET_DEVICES=lo NCCL_SOCKET_IFNAME=lo
# Byte-code for the checkout once, here: every rank of every job imports zerompi and the
# test workers, and where PYTHONDONTWRITEBYTECODE is set (as on our VMs) each of those
# hundreds of processes would compile them again (~0.25 CPU-s each, measured).
python -m compileall -q zerompi tests benchmarks > /dev/null
# Two pytest-xdist workers (the `test` extra): while one waits (a Slurm job, a deadline, a
# rank that sleeps) the other runs. Three (574-689 s, measured before the order below)
# cost CPU in contention and stretched start-up-sensitive timings (tests/README.md). The groups that must
# share a worker (one Slurm cluster, one bed of simulated nodes, the batched launches) are
# set by tests/conftest.py; ZEROMPI_TEST_WORKERS=N sets the number, 0 runs
# everything in this one process.
n_workers="${ZEROMPI_TEST_WORKERS:-2}"
workers=(-n "$n_workers" --dist loadgroup --no-loadscope-reorder)  # the order: conftest.py HEAD
if [ "$n_workers" = 0 ]; then workers=(); fi
if [ "$quick" = 1 ]; then
    exec python -m pytest -q -rs "${workers[@]}" -m "not mpi and not slurm and not system" tests "$@"
fi
# System packages for the real-Slurm, h5ls/h5dump and simulated-node (ip, tc, nsenter)
# tests (they skip where these cannot be installed, e.g. without root).
bash .ci/install_debian.sh slurmctld slurmd slurm-client munge hdf5-tools iproute2 util-linux
exec python -m pytest -q -rs "${workers[@]}" tests "$@"
