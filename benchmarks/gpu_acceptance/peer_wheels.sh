#!/usr/bin/env bash
# The DeepSpeed wheel set for the GPU acceptance run's peers step (run.sh here), made where PyPI is reachable:
#
#   bash benchmarks/gpu_acceptance/peer_wheels.sh DIR     # then carry DIR to the GPU machine, --wheels DIR
#
# deepspeed 0.19.8 is on PyPI as an sdist only: it is built here into a pure-Python wheel
# with DS_BUILD_OPS=0 (no compiled op; the benchmark gives DeepSpeed torch's AdamW, so none
# is JIT-built there either), against this machine's torch (--no-build-isolation: its
# setup.py imports torch; the wheel records that torch only for prebuilt ops, of which it
# has none). The others are what deepspeed needs and the GPU image lacks (its package list:
# /work/.library/device/KINDS.md), for CPython 3.12 on manylinux x86-64; typing_extensions
# is installed there only when the image's is older than pydantic needs. About 5 MB.
set -euo pipefail
if [ $# -ne 1 ]; then
    echo "usage: $0 DIR" >&2
    exit 2
fi
mkdir -p "$1"
DIR="$(cd "$1" && pwd)"
PY="${PYTHON:-python3}"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
"$PY" -m pip download -q --no-deps --no-binary :all: -d "$TMP" deepspeed==0.19.8
DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$DIR" "$TMP"/deepspeed-0.19.8.tar.gz
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$DIR" \
    hjson==3.1.0 pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2 \
    typing-extensions==4.16.0
ls -l "$DIR"
