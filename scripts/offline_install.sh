#!/usr/bin/env bash
# `bash install.sh --wheelhouse DIR [TARGET...]` (or ZEROMPI_WHEELHOUSE=DIR): zerompi
# from a folder of wheels, for machines with no network. Never reaches an index:
#   - pip runs with --no-index --find-links DIR only, reading no pip config file and no
#     PIP_* index/find-links settings;
#   - torch: an installed torch >= 2.3 (setup.py's range; 2.13 is tested on CPU, 2.11
#     is the GPU machine's) is kept, whatever its build (CPU, CUDA 12, CUDA 13);
#     without one, torch>=2.3 is installed from DIR;
#   - MPI: when mpi4py already loads an MPI library (a site MPI after `module load`, or
#     a pip one), that one is used; otherwise scripts/mpi_from_wheels.sh installs DIR's
#     mpich wheel (and mpi4py if this Python has none) with --prefix PREFIX
#     (ZEROMPI_MPI_PREFIX; default: this Python's venv, else ~/.local/zerompi-mpi) and
#     writes PREFIX/zerompi-mpi.env: `source` it in every shell and job script that
#     runs zerompi (it sets PATH, LD_LIBRARY_PATH, MPI4PY_LIBMPI);
#   - zerompi: pip install -e TARGET (default ".", e.g. ".[cuda13]"), dependencies from
#     DIR or already installed; built with the installed setuptools (no build
#     isolation) when there is one, else DIR must hold a setuptools wheel.
# Filling DIR on a machine with network, for the target's Python and platform, e.g.:
#   pip download -d DIR --only-binary=:all: --python-version 3.12 \
#       --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
#       mpich==5.0.2 mpi4py==4.1.2 numpy h5py tqdm matplotlib   # + cupy-cuda13x nvidia-nccl-cu13
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 1 ] || { echo "usage: $0 WHEEL_DIR [TARGET...]" >&2; exit 2; }
[ -d "$1" ] || { echo "install.sh: wheelhouse $1 is not a folder" >&2; exit 2; }
WHEELS="$(cd "$1" && pwd)"
shift
PY="${PYTHON:-python}"
export PIP_CONFIG_FILE=/dev/null PIP_NO_INPUT=1
unset PIP_INDEX_URL PIP_EXTRA_INDEX_URL PIP_FIND_LINKS PIP_CONSTRAINT PIP_REQUIREMENT
offline() { "$PY" -m pip install -q --no-index --find-links "$WHEELS" "$@"; }
echo "install.sh: offline: installing only from $WHEELS"

have="$("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null || true)"
if [ -n "$have" ] && "$PY" - "$have" <<'PYEOF'
import re, sys
m = re.match(r"(\d+)\.(\d+)", sys.argv[1])
sys.exit(0 if m and (int(m[1]), int(m[2])) >= (2, 3) else 1)
PYEOF
then
    echo "install.sh: torch $have is already installed (supported: >= 2.3); keeping it"
else
    echo "install.sh: torch ${have:-missing} is not >= 2.3: installing torch>=2.3 from $WHEELS"
    offline "torch>=2.3" || { echo "install.sh: no usable torch>=2.3 wheel in $WHEELS" >&2; exit 1; }
fi

if lib="$(timeout 60 "$PY" -c 'from mpi4py import MPI; print(MPI.Get_library_version().splitlines()[0])' 2>/dev/null)"; then
    echo "install.sh: MPI already works ($lib); keeping it"
else
    prefix="${ZEROMPI_MPI_PREFIX:-$("$PY" -c 'import sys; print(sys.prefix if sys.prefix != sys.base_prefix else "")')}"
    prefix="${prefix:-$HOME/.local/zerompi-mpi}"
    echo "install.sh: no working MPI: installing MPICH from $WHEELS into $prefix"
    PYTHON="$PY" bash scripts/mpi_from_wheels.sh "$WHEELS" "$prefix"
    # shellcheck disable=SC1091
    source "$prefix/zerompi-mpi.env"
    echo "install.sh: run 'source $prefix/zerompi-mpi.env' in every shell and job script that runs zerompi"
fi

if [ $# -eq 0 ]; then set -- "."; fi
build=()
# --use-pep517: the editable build through setuptools' own hook. Without it a pip before
# 23.1 (Debian's venvs) runs `setup.py develop`, which recent setuptools hands back to pip
# with build isolation on, and that reaches for an index.
if "$PY" -c "import setuptools" 2>/dev/null; then build=(--no-build-isolation --use-pep517); fi
echo "install.sh: installing zerompi: pip install --no-index --find-links $WHEELS ${build[*]} -e $*"
offline "${build[@]}" -e "$@"
"$PY" - <<'PYEOF'
import torch
cuda = torch.version.cuda
build = f"CUDA {cuda} build" if cuda else "CPU build"
gpus = torch.cuda.device_count() if cuda else 0
print(f"install.sh: torch {torch.__version__} ({build}); GPUs visible: {gpus}")
if cuda:
    print(f"install.sh: for NCCL and the fused kernels add the extra .[cuda{cuda.split('.')[0]}] (README, On GPUs)")
PYEOF
