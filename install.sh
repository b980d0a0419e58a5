#!/usr/bin/env bash
# Install zerompi with the torch build that fits this machine, and say which one it got.
#
#   bash install.sh                   # torch 2.13.0 + zerompi[mpich] (README command 1)
#   bash install.sh ".[mpich,test]"   # other extras: the arguments replace ".[mpich]"
#   ZEROMPI_TORCH=cpu|cuda|pypi|skip bash install.sh    # choose the torch build yourself
#
# Which torch (pinned 2.13.0: an unpinned torch pulls the newest CUDA build, several GB):
#   a GPU (nvidia-smi lists one)  -> PyPI's torch 2.13.0, the CUDA build with its
#                                    nvidia-* runtime wheels;
#   no GPU                        -> the CPU build (~200 MB) from PyTorch's CPU wheel index;
#                                    where that index cannot be reached (a machine that
#                                    reaches only PyPI), PyPI's pinned wheel instead, and
#                                    this script says so. That one is the CUDA build on
#                                    Linux x86_64: it runs on CPUs too, it is only larger.
#   torch 2.13.0 already there    -> kept.
# ZEROMPI_TORCH_CPU_INDEX overrides the CPU index (a site mirror).
#
# Offline (air-gapped nodes): everything from a folder of wheels, never the network:
#   bash install.sh --wheelhouse DIR [".[cuda13]"]      # or ZEROMPI_WHEELHOUSE=DIR
#   -> scripts/offline_install.sh (what it does, and how to fill DIR, is written there).
set -euo pipefail
cd "$(dirname "$0")"
if [ "${1:-}" = "--wheelhouse" ]; then
    [ $# -ge 2 ] || { echo "install.sh: --wheelhouse needs a folder" >&2; exit 2; }
    ZEROMPI_WHEELHOUSE="$2"
    shift 2
fi
if [ -n "${ZEROMPI_WHEELHOUSE:-}" ]; then
    exec bash scripts/offline_install.sh "$ZEROMPI_WHEELHOUSE" "$@"
fi
PIN="torch==2.13.0"
CPU_INDEX="${ZEROMPI_TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"
PY="${PYTHON:-python}"
pip_install() { "$PY" -m pip install -q "$@"; }

want="${ZEROMPI_TORCH:-auto}"
if [ "$want" = auto ]; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q GPU; then
        want=cuda
    else
        want=cpu
    fi
fi
have="$("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null || true)"
if [ "${have%%+*}" = "2.13.0" ] && [ "${ZEROMPI_TORCH:-auto}" = auto ]; then
    echo "install.sh: torch $have is already installed; keeping it"
elif [ "$want" = skip ]; then
    echo "install.sh: ZEROMPI_TORCH=skip: not installing torch"
elif [ "$want" = cpu ]; then
    echo "install.sh: no GPU found: installing the CPU build of $PIN from $CPU_INDEX"
    # --retries 0 / --timeout: an unreachable index should cost seconds, not minutes.
    if ! pip_install "$PIN" --index-url "$CPU_INDEX" --retries 0 --timeout 20; then
        echo "install.sh: $CPU_INDEX cannot be reached: installing PyPI's $PIN instead"
        pip_install "$PIN"
    fi
else  # cuda or pypi: the pinned wheel from the default index (PyPI)
    echo "install.sh: installing $PIN from the default index (PyPI: the CUDA build on Linux x86_64)"
    pip_install "$PIN"
fi

if [ $# -eq 0 ]; then set -- ".[mpich]"; fi
echo "install.sh: installing zerompi: pip install -e $*"
pip_install -e "$@"
"$PY" - <<'PYEOF'
import torch
cuda = torch.version.cuda
build = f"CUDA {cuda} build" if cuda else "CPU build"
gpus = torch.cuda.device_count() if cuda else 0
print(f"install.sh: torch {torch.__version__} ({build}); GPUs visible: {gpus}")
PYEOF
