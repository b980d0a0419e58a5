#!/usr/bin/env bash
# The GPU acceptance run: benchmarks/gpu_acceptance/run.sh (its header says what it runs).
#   bash benchmarks/gpu_acceptance.sh OUTDIR [--dry-run] [--wheels DIR] [--budget S] ...
exec bash "$(dirname "$0")/gpu_acceptance/run.sh" "$@"
