#!/usr/bin/env bash
# GPU acceptance (issue 24): the whole GPU path checked on one GPU, offline, within a
# hard time budget, results written as the steps finish.
#
#   bash benchmarks/gpu_acceptance.sh OUTDIR [--dry-run] [--wheels DIR] [--budget S]
#        [--skip STEP,...] [--kernel-sizes 1e7,1e8,1e9] [--e2e-preset gpt2] [--commit SHA]
#
# Runs from the repository root without installing anything (PYTHONPATH is the
# checkout); the only install is MPICH from --wheels DIR when mpi4py loads no MPI
# (scripts/mpi_from_wheels.sh, into a temporary prefix). Steps, most important first;
# each runs under `timeout -s INT` with the smaller of its cap and what is left of the
# budget (default 480 s), and does not start with less than its minimum left:
#   1 env-probe      (cap  45 s) env.json: GPU, driver, compute mode, torch/cupy/NCCL,
#                    NCCL loads, _swap_data_ptr_, MPI, nvcc, hostname resolution
#   2 mpi            (cap  60 s) MPI from --wheels if none works, then 2 ranks
#                    (benchmarks/mpi_smoke.py: CPU and, with a GPU, CUDA tensors)
#   3 kernel-tests   (cap 120 s) kernels_junit.xml: kernels vs numpy references, GPU
#                    placement, NCCL dtypes; no MPI
#   4 kernel-bench   (cap  60 s) kernels_bench.json: fused AdamW / norm / cast bytes/s vs
#                    the GPU's copy bandwidth, vs torch.optim.AdamW(fused=True)
#   5 mpi-gpu-tests  (cap 180 s) mpi_junit.xml: every MPI test that needs the GPU (parity
#                    N = 1 NCCL, N = 2-3 sharing the GPU, no device sync in a step,
#                    offload, staged and NCCL collectives, device binding); pytest-xdist
#                    -n 4 where installed; every launch capped at 150 s
#   6 e2e            (cap 120 s) e2e.json: GPT-2 124M, stages 0-3 vs plain torch, tokens/s,
#                    MFU, peak memory, host- and device-side profiles of plain torch and
#                    stages 0, 2, 3 (step_profile.py), stage 3 again with 8 bucket slots (the
#                    reducer's host wait), a 60-step corpus run whose loss must fall
#     train-cmd      (cap  60 s) `python -m zerompi.train` on 2 ranks, device auto, tiny
#                    preset, 20 steps and a checkpoint (the log)
#   7 build-tests    (cap  60 s) build_junit.xml: nvcc and NVRTC compile tests
#   8 e2e-1b         (cap 150 s) e2e_1b.json: the 1B preset, stages 2-3, stage 2 with the
#                    optimizer offloaded (peak GPU memory)
# --commit SHA: the commit the tree holds, as the caller knows it (a copy of a working tree
# sent to a GPU machine can carry a stale .git); recorded beside `git describe`.
# OUTDIR gets at most these 8 files plus acceptance.log. Each step ends with a line
# "STEP <name> <ok|fail|timeout|skip> <seconds>s <detail>" in the log and an entry in
# env.json's "steps", so a run cut off anywhere keeps the probe and the answers so far.
# --dry-run hides the GPUs (CUDA_VISIBLE_DEVICES=""): the same steps run, GPU tests skip
# with their reasons, GPU-only benchmarks write {"skipped": why}, and the e2e steps run
# the tiny preset on the CPU (a check of the script, not a measurement).
set -uo pipefail  # not -e: one failing step must not end the run
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"

usage() { sed -n '4,6p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
[ $# -ge 1 ] || usage
OUT="$1"
shift
DRY=0 WHEELS="" BUDGET=480 SKIP="" KSIZES="1e7,1e8,1e9" PRESET="gpt2"
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY=1; shift ;;
        --wheels) WHEELS="$(cd "$2" && pwd)" || usage; shift 2 ;;
        --budget) BUDGET="$2"; shift 2 ;;
        --skip) SKIP=",$2,"; shift 2 ;;
        --kernel-sizes) KSIZES="$2"; shift 2 ;;
        --e2e-preset) PRESET="$2"; shift 2 ;;
        --commit) export ZEROMPI_COMMIT="$2"; shift 2 ;;
        *) usage ;;
    esac
done
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
LOG="$OUT/acceptance.log" ENVF="$OUT/env.json"
rm -f "$LOG" "$ENVF" "$OUT"/{kernels_junit.xml,kernels_bench.json,mpi_junit.xml,e2e.json,build_junit.xml,e2e_1b.json}
START=$(date +%s)
PY="${PYTHON:-$(command -v python3 || command -v python)}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export UCX_NET_DEVICES="${UCX_NET_DEVICES:-lo}" NCCL_SOCKET_IFNAME="${NCCL_SOCKET_IFNAME:-lo}"
if [ "$DRY" = 1 ]; then export CUDA_VISIBLE_DEVICES=""; fi
MPI_TMP=""
trap '[ -n "$MPI_TMP" ] && rm -rf "$MPI_TMP"' EXIT

log() { echo "$*" | tee -a "$LOG"; }
left() { echo $((BUDGET - ($(date +%s) - START))); }
decided() {  # decided KEY: a choice the probe made (env.json "decide"), empty if none
    "$PY" -c 'import json,sys; print(json.load(open(sys.argv[1])).get("decide", {}).get(sys.argv[2], ""))' \
        "$ENVF" "$1" 2>/dev/null
}
report() {  # report NAME STATUS SECONDS DETAIL: one log line and env.json's "steps"
    log "STEP $1 $2 ${3}s ${4:-}"
    "$PY" - "$ENVF" "$@" <<'PYEOF' 2>>"$LOG"
import json, os, sys
path, name, status, secs, detail = sys.argv[1:5] + [" ".join(sys.argv[5:])]
d = json.load(open(path)) if os.path.exists(path) else {}
d.setdefault("steps", []).append({"step": name, "status": status, "seconds": int(secs), "detail": detail})
json.dump(d, open(path, "w"), indent=1)
PYEOF
}
skip_json() { printf '{"skipped": "%s"}\n' "$2" > "$1"; }

# step NAME CAP MIN CMD...: CMD under `timeout -s INT` (pytest writes its JUnit file when
# interrupted), output to the log; 15 s of the budget stay for the kill grace.
step() {
    local name=$1 cap=$2 min=$3 l t0 rc st
    shift 3
    l=$(($(left) - 15))
    if [[ "$SKIP" == *",$name,"* ]]; then report "$name" skip 0 "--skip"; return 1; fi
    if [ "$l" -lt "$min" ]; then report "$name" skip 0 "budget: ${l}s left, needs ${min}s"; return 1; fi
    [ "$cap" -gt "$l" ] && cap=$l
    log "=== $name (cap ${cap}s; $(left)s of the ${BUDGET}s budget left): $*"
    t0=$(date +%s)
    timeout -s INT -k 15 "$cap" "$@" >>"$LOG" 2>&1
    rc=$?
    case $rc in 0) st=ok ;; 124 | 137) st=timeout ;; *) st=fail ;; esac
    report "$name" "$st" $(($(date +%s) - t0)) "rc $rc"
    return 0
}
pytest_step() {  # pytest_step NAME CAP MIN JUNIT PYTEST-ARGS...
    local name=$1 cap=$2 min=$3 junit=$4
    shift 4
    local extra=()
    if "$PY" -c "import pytest_timeout" 2>/dev/null; then extra+=(--timeout "$cap"); fi
    step "$name" "$cap" "$min" "$PY" -m pytest -q -rs -p no:cacheprovider --junitxml "$OUT/$junit" "${extra[@]}" "$@"
}
# An MPI "works" when mpiexec starts 2 ranks that meet in a barrier: mpi4py loading a
# library is not enough (the GPU machine's Debian Open MPI loads, but its mpiexec
# refuses to run as root), and then MPICH from --wheels is used instead.
mpi_works() {
    command -v mpiexec >/dev/null &&
        timeout 60 mpiexec -n 2 "$PY" -c "from mpi4py import MPI; MPI.COMM_WORLD.Barrier()" >>"$LOG" 2>&1
}

log "gpu_acceptance: $(date -u +%FT%TZ) commit $(git describe --always --dirty 2>/dev/null)${ZEROMPI_COMMIT:+ (given: $ZEROMPI_COMMIT)} budget ${BUDGET}s dry-run $DRY"

# 1 ---------------------------------------------------------------- environment
step env-probe 45 10 "$PY" benchmarks/gpu_env_probe.py "$ENVF"
GPU=$(decided gpu)
BACKEND=$(decided e2e_backend)
PEAK=$(decided peak_bf16_flops)
NOGPU="no CUDA device visible"
[ -z "$GPU" ] && NOGPU="the probe gave no answer (step env-probe): taken as no GPU"

# 2 ---------------------------------------------------------------- MPI
t0=$(date +%s)
log "=== mpi ($(left)s of the budget left)"
HAVE_MPI=0
mpi_works && HAVE_MPI=1
if [ "$HAVE_MPI" = 0 ]; then
    if [ -n "$WHEELS" ] && [ "$(left)" -gt 60 ]; then
        MPI_TMP="$(mktemp -d)"
        log "no working MPI: MPICH from $WHEELS"
        if PYTHON="$PY" timeout 45 bash scripts/mpi_from_wheels.sh "$WHEELS" "$MPI_TMP" >>"$LOG" 2>&1; then
            # shellcheck disable=SC1091
            source "$MPI_TMP/zerompi-mpi.env"
            mpi_works && HAVE_MPI=1
        fi
    else
        log "no working MPI and no --wheels DIR (or no time) to install one from"
    fi
fi
if [ "$HAVE_MPI" = 1 ]; then
    step mpi 60 20 mpiexec -n 2 "$PY" -m mpi4py benchmarks/mpi_smoke.py
else
    report mpi fail $(($(date +%s) - t0)) "no MPI: mpiexec -n 2 cannot get two mpi4py ranks through a barrier"
fi
MPI_OK=0
grep -aq "^STEP mpi ok" "$LOG" && MPI_OK=1

# 3 ---------------------------------------------------------------- kernels, no MPI
pytest_step kernel-tests 120 30 kernels_junit.xml tests/unit/test_kernels_gpu.py \
    tests/unit/test_placement.py::test_pinned_host_placement \
    tests/unit/test_placement.py::test_cuda_placement_allocates_on_the_device \
    tests/unit/test_nccl_module.py::test_nccl_dtype_map_matches_cupy

# 4 ---------------------------------------------------------------- kernel bandwidth
if [ "$GPU" = True ]; then
    step kernel-bench 60 20 "$PY" benchmarks/bench_kernels_gpu.py --sizes "$KSIZES" --out "$OUT/kernels_bench.json"
else
    skip_json "$OUT/kernels_bench.json" "$NOGPU"
    report kernel-bench skip 0 "$NOGPU"
fi

# 5 ---------------------------------------------------------------- MPI tests on the GPU
if [ "$MPI_OK" = 1 ]; then
    par=()
    if [ "$GPU" = True ] && "$PY" -c "import xdist" 2>/dev/null; then par=(-n 4); fi
    ZEROMPI_TEST_LAUNCH_CAP=150 pytest_step mpi-gpu-tests 180 60 mpi_junit.xml "${par[@]}" \
        tests/multirank/test_engine_gpu.py tests/multirank/test_comm_gpu.py::test_staged_collectives_on_gpu \
        tests/multirank/test_comm_gpu.py::test_nccl_collectives_one_rank_per_gpu \
        tests/multirank/test_device.py::test_local_ranks_and_detection
else
    report mpi-gpu-tests skip 0 "no working MPI (step mpi)"
fi

# 6 ---------------------------------------------------------------- end to end
e2e() {  # e2e NAME CAP OUTFILE GPU-ARGS... -- CPU-ARGS...
    local name=$1 cap=$2 out=$3 gpu=() cpu=()
    shift 3
    while [ $# -gt 0 ] && [ "$1" != "--" ]; do gpu+=("$1"); shift; done
    shift
    cpu=("$@")
    if [ "$GPU" = True ]; then
        step "$name" "$cap" 40 "$PY" benchmarks/bench_gpu_e2e.py --backend "${BACKEND:-auto}" \
            --peak-flops "${PEAK:-0}" --out "$out" "${gpu[@]}"
    elif [ "$DRY" = 1 ]; then
        step "$name" "$cap" 20 "$PY" benchmarks/bench_gpu_e2e.py --device cpu --backend mpi --preset tiny \
            --micro 2 --seq 32 --warmup 1 --steps 1 --out "$out" "${cpu[@]}"
    else
        skip_json "$out" "$NOGPU"
        report "$name" skip 0 "$NOGPU"
    fi
}
e2e e2e 120 "$OUT/e2e.json" --preset "$PRESET" --micro 8 --seq 1024 --train-steps 60 --profile-stages 0,2,3 \
    --stage3-slots 8 -- --stages 0,3 --train-steps 30 --stage3-slots 8

# 6b --------------------------------------------------------------- the main job
# `python -m zerompi.train` as users run it: 2 ranks (on one GPU they share it), device
# auto, the tiny preset on the bundled corpus, 20 steps and a checkpoint; output in the log,
# and the device it resolved to.
if [ "$MPI_OK" = 1 ]; then
    TRAIN_TMP="$(mktemp -d)"
    ZEROMPI_CACHE="$TRAIN_TMP/cache" step train-cmd 60 20 mpiexec -n 2 "$PY" -m zerompi.train \
        --model.preset tiny --max_steps 20 --global_batch 8 --checkpoint_interval 10 --log_interval 5 \
        --progress lines --run_dir "$TRAIN_TMP/run"
    log "train-cmd device: $("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["device"])' \
        "$TRAIN_TMP/run/config.json" 2>&1)"
    rm -rf "$TRAIN_TMP"
else
    report train-cmd skip 0 "no working MPI (step mpi)"
fi

# 7 ---------------------------------------------------------------- if time is left
pytest_step build-tests 60 20 build_junit.xml tests/unit/test_kernels_build.py -k "nvcc_compiles or nvrtc_compiles"
e2e e2e-1b 150 "$OUT/e2e_1b.json" --preset gpt-1b --micro 4 --seq 1024 --stages 2,3 --offload \
    --warmup 1 --steps 3 --profile-stages none -- --stages 2 --offload --profile-stages none

log "=== summary ($(($(date +%s) - START))s of ${BUDGET}s)"
grep -a "^STEP " "$LOG"  # -a: the probe logs an MPI version string with a NUL
! grep -aqE "^STEP [^ ]+ (fail|timeout)" "$LOG"
