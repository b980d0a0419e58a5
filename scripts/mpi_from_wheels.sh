#!/usr/bin/env bash
# An MPI from a folder of wheels, offline: PyPI's MPICH (and mpi4py when this Python
# has none) installed with `pip install --no-index --no-deps --prefix PREFIX`.
#
#   bash scripts/mpi_from_wheels.sh WHEEL_DIR PREFIX     # then: source PREFIX/zerompi-mpi.env
#
# Why --prefix: pip's --target drops the mpich wheel's data files (bin/, lib/ with
# libmpi.so.12). Why MPI4PY_LIBMPI=PREFIX/lib/libmpi.so.12: the wheel's libmpi.so is
# a linker script, which dlopen cannot load, and mpi4py >= 4 finds a library by
# itself only under its own environment's prefix. The env file puts PREFIX/bin
# (mpiexec) on PATH, PREFIX/lib and PREFIX/lib/mpich on LD_LIBRARY_PATH, sets
# MPI4PY_LIBMPI, and adds mpi4py's folder to PYTHONPATH when it was installed here.
# pip reads no config file and no PIP_* index settings here: the folder is the only source.
set -euo pipefail
if [ $# -ne 2 ]; then
    echo "usage: $0 WHEEL_DIR PREFIX" >&2
    exit 2
fi
WHEELS="$(cd "$1" && pwd)"
mkdir -p "$2"
PREFIX="$(cd "$2" && pwd)"
PY="${PYTHON:-python}"
export PIP_CONFIG_FILE=/dev/null PIP_NO_INPUT=1
unset PIP_INDEX_URL PIP_EXTRA_INDEX_URL PIP_FIND_LINKS PIP_CONSTRAINT PIP_REQUIREMENT
# --ignore-installed: a copy elsewhere (a base environment seen through a venv) must not
# stand in for the one under PREFIX
offline() { "$PY" -m pip install -q --no-index --no-deps --ignore-installed --find-links "$WHEELS" --prefix "$PREFIX" "$@"; }

need() {
    offline "$1" || { echo "mpi_from_wheels: no usable $1 wheel in $WHEELS (pip download --no-deps $2)" >&2; exit 1; }
}
need mpich "mpich==5.0.2"
pypath=""
if ! "$PY" -c "import mpi4py" 2>/dev/null; then
    need mpi4py "mpi4py==4.1.2"
    init="$(find "$PREFIX" -path '*/mpi4py/__init__.py' | head -n 1)"
    pypath="$(dirname "$(dirname "$init")")"
fi
lib="$PREFIX/lib/libmpi.so.12"
[ -f "$lib" ] || { echo "mpi_from_wheels: $lib missing after the install" >&2; exit 1; }
envfile="$PREFIX/zerompi-mpi.env"
{
    echo "# MPICH from $WHEELS (scripts/mpi_from_wheels.sh): source this file before mpiexec/python"
    echo "export PATH=\"$PREFIX/bin\${PATH:+:\$PATH}\""
    echo "export LD_LIBRARY_PATH=\"$PREFIX/lib:$PREFIX/lib/mpich\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}\""
    echo "export MPI4PY_LIBMPI=\"$lib\""
    if [ -n "$pypath" ]; then echo "export PYTHONPATH=\"$pypath\${PYTHONPATH:+:\$PYTHONPATH}\""; fi
} > "$envfile"
# shellcheck disable=SC1090
source "$envfile"
"$PY" -c "from mpi4py import MPI; print('mpi_from_wheels:', MPI.Get_library_version().splitlines()[0])"
echo "mpi_from_wheels: wrote $envfile"
