#!/usr/bin/env bash
# GPU acceptance: the whole GPU path checked on one GPU, offline, within
# a hard time budget, results written as the steps finish.
#
#   bash benchmarks/gpu_acceptance/run.sh OUTDIR [--dry-run] [--wheels DIR] [--budget S]
#        [--skip STEP,...|none] [--e2e-preset gpt2] [--commit SHA]
#
# Runs from the repository root without installing into the image (PYTHONPATH is the
# checkout); from --wheels DIR it installs, into temporary folders, MPICH when mpi4py
# loads no working MPI (scripts/mpi_from_wheels.sh) and DeepSpeed with the packages it
# lacks there when deepspeed does not import (benchmarks/gpu_acceptance/peer_wheels.sh makes that set).
# Steps, most important first; each runs under `timeout -s INT` with the smaller of its cap
# and what is left of the budget (default 390 s), and does not start with less than its
# minimum left (a cut drops the last ones); expected seconds on an H100/H200 in brackets:
#    1 env-probe     (cap  45 s) [16] env.json: GPU, driver, torch/cupy/NCCL, MPI, nvcc, peers
#    2 mpi           (cap  45 s) [ 6] MPI from --wheels if none works, then 2 ranks (mpi_smoke.py)
#    3 peers         (cap  30 s) [ 5] DeepSpeed from --wheels into a temporary --target when
#                    deepspeed does not import; skip without wheels
#    4 kernel-tests  (cap  90 s) [14] kernels_junit.xml: the GPU unit tests (kernels, placement,
#                    NCCL dtypes, the step's coefficient, offload, pinned staging, host pass)
#    5 mpi-gpu-tests (cap 150 s) [76] mpi_junit.xml: every MPI test that needs the GPU; -n 4
#    6 e2e           (cap 110 s) [65] e2e.json: bench_gpu_e2e.py, GPT-2 124M (micro 8 x 1024),
#                    plain torch, FSDP2, stages 0-3, then DeepSpeed ZeRO-2/3 in a group of
#                    their own; 8 rounds x 3 steps, all profiled; a 60-step corpus run
#    7 e2e-1b        (cap 130 s) [70] e2e_1b.json: the 1B preset (micro 4 x 1024), 6 rounds x 2
#    8 train-cmd     (cap  60 s) [20] `python -m zerompi.train` on 2 ranks, tiny, 20 steps + a checkpoint
#    9 proxy         (cap  60 s) host_proxy.json: bench_host_proxy.py on this machine's CPU
#   10 offload       (cap 150 s) offload.json: bench_offload_gpu.py, 1B, --delayed --capacity
#   11 build-tests   (cap  60 s) [20] build_junit.xml: nvcc and NVRTC compiles; in the default --skip
# --skip LIST replaces the default list (build-tests); `--skip none` runs every step. --commit SHA: the
# commit the tree holds, as the caller knows it (a copied tree can carry a stale .git).
# Each step ends with "STEP <name> <ok|fail|timeout|skip> <seconds>s <detail>" in
# acceptance.log and an entry in env.json's "steps": a run cut off anywhere keeps what it
# has; the log ends with the e2e table (e2e_summary.py) and the STEP lines.
# --dry-run hides the GPUs (CUDA_VISIBLE_DEVICES=""): GPU tests skip with their reasons,
# GPU-only benchmarks write {"skipped": why}, e2e and proxy run the tiny preset on the CPU.
set -uo pipefail  # not -e: one failing step must not end the run
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
HERE=benchmarks/gpu_acceptance
cd "$ROOT"

usage() { sed -n '5,6p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
[ $# -ge 1 ] || usage
OUT="$1"
shift
DRY=0 WHEELS="" BUDGET=390 SKIP=",build-tests," PRESET="gpt2"
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY=1; shift ;;
        --wheels) WHEELS="$(cd "$2" && pwd)" || usage; shift 2 ;;
        --budget) BUDGET="$2"; shift 2 ;;
        --skip) SKIP=",$2,"; shift 2 ;;
        --e2e-preset) PRESET="$2"; shift 2 ;;
        --commit) export ZEROMPI_COMMIT="$2"; shift 2 ;;
        *) usage ;;
    esac
done
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
LOG="$OUT/acceptance.log" ENVF="$OUT/env.json"
rm -f "$LOG" "$ENVF" "$OUT"/{kernels_junit.xml,mpi_junit.xml,e2e.json,build_junit.xml,e2e_1b.json} \
    "$OUT"/{host_proxy.json,offload.json}
START=$(date +%s)
PY="${PYTHON:-$(command -v python3 || command -v python)}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export UCX_NET_DEVICES="${UCX_NET_DEVICES:-lo}" NCCL_SOCKET_IFNAME="${NCCL_SOCKET_IFNAME:-lo}"
if [ "$DRY" = 1 ]; then export CUDA_VISIBLE_DEVICES=""; fi
MPI_TMP="" PEERS=""
trap 'rm -rf ${MPI_TMP:+"$MPI_TMP"} ${PEERS:+"$PEERS"}' EXIT

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
step env-probe 45 10 "$PY" "$HERE/env_probe.py" "$ENVF"
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
    step mpi 45 20 mpiexec -n 2 "$PY" -m mpi4py "$HERE/mpi_smoke.py"
else
    report mpi fail $(($(date +%s) - t0)) "no MPI: mpiexec -n 2 cannot get two mpi4py ranks through a barrier"
fi
MPI_OK=0
grep -aq "^STEP mpi ok" "$LOG" && MPI_OK=1

# 3 ---------------------------------------------------------------- peers: DeepSpeed
# Only what does not import goes into a temporary --target, seen by the e2e steps alone
# (PEERS_PATH): deepspeed, hjson, pydantic with its parts, and typing_extensions only when
# the image's is older than pydantic needs (first on the path, a carried one would shadow it).
imports() { "$PY" -c "import $1" >/dev/null 2>&1; }
peer_names=(deepspeed)
imports hjson || peer_names+=(hjson)
imports pydantic || peer_names+=(pydantic pydantic_core annotated_types typing_inspection)
"$PY" -c 'from importlib.metadata import version as v
raise SystemExit(tuple(int(x) for x in v("typing_extensions").split(".")[:3]) < (4, 14, 1))' 2>/dev/null ||
    peer_names+=(typing_extensions)
PEER_WHEELS=()
if [ -n "$WHEELS" ]; then
    for n in "${peer_names[@]}"; do
        for w in "$WHEELS/$n"-*.whl; do [ -f "$w" ] && PEER_WHEELS+=("$w"); done
    done
fi
if imports deepspeed; then
    report peers ok 0 "deepspeed imports without wheels"
elif ! compgen -G "$WHEELS/deepspeed-*.whl" >/dev/null; then
    report peers skip 0 "deepspeed does not import and no deepspeed wheel in --wheels: DeepSpeed skipped"
else
    PEERS="$(mktemp -d)"
    PIP_CONFIG_FILE=/dev/null PIP_NO_INPUT=1 step peers 30 10 "$PY" -m pip install -q --no-index --no-deps \
        --no-compile --target "$PEERS" "${PEER_WHEELS[@]}"
    log "peers: $(PYTHONPATH="$PEERS:$PYTHONPATH" "$PY" -c 'import deepspeed, pydantic
print("deepspeed", deepspeed.__version__, "pydantic", pydantic.VERSION)' 2>&1 | tail -n 1)"
fi
PEERS_PATH="${PEERS:+$PEERS:}$PYTHONPATH"

# 4 ---------------------------------------------------------------- kernels, no MPI
pytest_step kernel-tests 90 20 kernels_junit.xml tests/unit/test_kernels_gpu.py \
    tests/unit/test_placement.py::test_pinned_host_placement \
    tests/unit/test_placement.py::test_cuda_placement_allocates_on_the_device \
    tests/unit/test_nccl_module.py::test_nccl_dtype_map_matches_cupy \
    tests/unit/test_step_coef.py tests/unit/test_offload.py::test_staged_and_delayed_on_the_gpu \
    tests/unit/test_host_pass.py::test_host_zeros_registers_pages_for_the_gpu \
    tests/unit/test_host_pass.py::test_compiled_pass_is_the_reference_bit_for_bit

# 5 ---------------------------------------------------------------- MPI tests on the GPU
if [ "$MPI_OK" = 1 ]; then
    par=()
    if [ "$GPU" = True ] && "$PY" -c "import xdist" 2>/dev/null; then par=(-n 4); fi
    ZEROMPI_TEST_LAUNCH_CAP=120 pytest_step mpi-gpu-tests 150 60 mpi_junit.xml "${par[@]}" \
        tests/multirank/test_engine_gpu.py tests/multirank/test_comm_gpu.py::test_staged_collectives_on_gpu \
        tests/multirank/test_comm_gpu.py::test_nccl_collectives_one_rank_per_gpu \
        tests/multirank/test_device.py::test_local_ranks_and_detection
else
    report mpi-gpu-tests skip 0 "no MPI: the MPI tests cannot launch"
fi

# 6, 7 ------------------------------------------------------------- end to end
e2e() {  # e2e NAME CAP MIN OUTFILE SYSTEMS GPU-ARGS... -- CPU-ARGS...
    local name=$1 cap=$2 min=$3 out=$4 systems=$5 gpu=() cpu=()
    shift 5
    while [ $# -gt 0 ] && [ "$1" != "--" ]; do gpu+=("$1"); shift; done
    shift
    cpu=("$@")
    if [ "$GPU" = True ]; then
        step "$name" "$cap" "$min" env PYTHONPATH="$PEERS_PATH" "$PY" benchmarks/bench_gpu_e2e.py \
            --backend "${BACKEND:-auto}" --peak-flops "${PEAK:-0}" --systems "$systems" --out "$out" "${gpu[@]}"
    elif [ "$DRY" = 1 ]; then
        step "$name" "$cap" 20 env PYTHONPATH="$PEERS_PATH" "$PY" benchmarks/bench_gpu_e2e.py --device cpu \
            --backend mpi --preset tiny --micro 2 --seq 32 --warmup 1 --rounds 2 --steps 1 --profile-steps 1 \
            --out "$out" "${cpu[@]}"
    else
        skip_json "$out" "$NOGPU"
        report "$name" skip 0 "$NOGPU"
    fi
}
# the dry run: every system of the 124M step (the GPU run's list), two of the 1B step's
e2e e2e 110 40 "$OUT/e2e.json" torch,fsdp2,stage0,stage1,stage2,stage3/deepspeed2,deepspeed3 \
    --preset "$PRESET" --micro 8 --seq 1024 --warmup 3 --rounds 8 --steps 3 --train-steps 60 -- \
    --systems torch,fsdp2,stage0,stage1,stage2,stage3/deepspeed2,deepspeed3 --train-steps 30
e2e e2e-1b 130 60 "$OUT/e2e_1b.json" torch,fsdp2,stage0,stage1,stage2,stage3 \
    --preset gpt-1b --micro 4 --seq 1024 --warmup 2 --rounds 6 --steps 2 --profile-steps 2 -- \
    --systems torch,stage3

# 8 ---------------------------------------------------------------- the main job
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

# 9 ---------------------------------------------------------------- host-cost proxy (CPU)
if [ "$DRY" = 1 ]; then pargs=(--models tiny --stages 0,3); else pargs=(--models gpt2,gpt-1b --stages 0,1,2,3); fi
step proxy 60 20 "$PY" benchmarks/bench_host_proxy.py "${pargs[@]}" --world 1 --no-plot --out "$OUT/host_proxy.json"

# 10 --------------------------------------------------------------- offloaded optimizer
if [ "$GPU" = True ]; then
    # one run: the phases, the delayed update at a batch it can hide behind, capacity
    step offload 150 40 "$PY" benchmarks/bench_offload_gpu.py --preset gpt-1b --steps 3 --delayed \
        --capacity --out "$OUT/offload.json"
else
    skip_json "$OUT/offload.json" "$NOGPU"
    report offload skip 0 "$NOGPU"
fi

# 11 ---------------------------------------------------------------- answered before: if time is left
pytest_step build-tests 60 20 build_junit.xml tests/unit/test_kernels_build.py -k "nvcc_compiles or nvrtc_compiles"

log "=== e2e summary"
"$PY" "$HERE/e2e_summary.py" "$OUT/e2e.json" "$OUT/e2e_1b.json" 2>&1 | tee -a "$LOG"
log "=== summary ($(($(date +%s) - START))s of ${BUDGET}s)"
grep -a "^STEP " "$LOG"  # -a: the probe logs an MPI version string with a NUL
! grep -aqE "^STEP [^ ]+ (fail|timeout)" "$LOG"
