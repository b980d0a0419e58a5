# Shared by the zerompi sbatch templates (sourced, not submitted): run the training
# step, relay the time-limit warning to it, and requeue the job when the trainer asks.
#
#   . "$ZEROMPI_SLURM_DIR/_requeue.sh"
#   zerompi_launcher                 # ZEROMPI_LAUNCH: the srun (or mpiexec) line for MPI_TYPE
#   zerompi_run "${ZEROMPI_LAUNCH[@]}" python -m zerompi.train ...
#   zerompi_requeue_or_exit "$ZEROMPI_RC"
#
# Why a relay: `#SBATCH --signal=B:USR1@T` sends USR1 to the batch shell only (srun and
# the ranks never see it). The trap below passes it to srun, which forwards it to every
# rank; zerompi.train then checkpoints (all ranks at the same step) and exits 124.
# The batch shell is read from the spool copy made at submission, but this file is read
# when each run starts: edits here reach jobs already in the queue.

# zerompi.train's "stopped by a signal after a checkpoint: requeue me" exit code.
ZEROMPI_REQUEUE_EXIT=124
# zerompi.train's "a collective wait passed zero.comm.timeout_s" exit code: the watchdog
# named ranks that did not answer, as when a node is lost.
ZEROMPI_LOST_EXIT=3
# Give up after this many restarts that followed a failure (a node lost, preemption: Slurm
# requeued the job, not this script), so that a job whose every run fails does not cycle
# forever. The requeues this script asks for at the time limit do not count: a long run
# needs as many of them as it takes. Override at submission: MAX_RESTARTS=50 sbatch ...
MAX_RESTARTS=${MAX_RESTARTS:-10}
# Deadline on MPI_Init (zerompi/runtime/startup.py): a launch whose process manager never
# answers ends with one line naming the launcher and MPI instead of waiting for --time.
export ZEROMPI_STARTUP_TIMEOUT_S=${ZEROMPI_STARTUP_TIMEOUT_S:-300}

zerompi_log() {
    echo "[$(date -Is)] job ${SLURM_JOB_ID:-?} restart ${SLURM_RESTART_COUNT:-0}: $*"
}

# zerompi_launcher: ZEROMPI_LAUNCH = how the ranks start, by MPI_TYPE:
#   auto (default)  pmi2 on one node, hydra across nodes: pip's MPICH (what install.sh
#                   installs) speaks only pmi2 to srun (pmix aborts it, none gives N
#                   one-rank worlds), and across nodes srun --mpi=pmi2 can hang it in
#                   MPI_Init (a PMI record longer than Slurm's pmi2 plugin takes:
#                   slurm/README.md, "MPI"); MPICH's own mpiexec serves PMI itself
#   hydra           mpiexec -bootstrap slurm (MPIEXEC: another mpiexec)
#   pmix, pmi2 ...  srun --mpi=MPI_TYPE --kill-on-bad-exit=1 (a site MPI built with PMIx: pmix)
# --kill-on-bad-exit=1: a rank that dies (even in MPI_Init) ends the step instead of leaving
# the others blocked in a collective until the time limit; hydra does that by itself.
zerompi_launcher() {
    local kind=${MPI_TYPE:-auto}
    if [ "$kind" = auto ]; then
        kind=pmi2
        if [ "${SLURM_JOB_NUM_NODES:-1}" -gt 1 ]; then kind=hydra; fi
    fi
    if [ "$kind" = hydra ]; then
        ZEROMPI_LAUNCH=("${MPIEXEC:-mpiexec}" -bootstrap slurm -n "$SLURM_NTASKS")
        if [ -n "${SLURM_NTASKS_PER_NODE:-}" ]; then
            ZEROMPI_LAUNCH+=(-ppn "${SLURM_NTASKS_PER_NODE%%(*}")
        fi
    else
        ZEROMPI_LAUNCH=(srun --mpi="$kind" --kill-on-bad-exit=1)
    fi
}

# Restarts after failures: SLURM_RESTART_COUNT less the requeues this script asked for,
# which it writes to RUN_DIR (it survives the requeue; a resubmission starts a new job
# id and a new count).
_zerompi_ledger() {
    echo "${RUN_DIR:-.}/.slurm-requeues"
}
zerompi_failed_restarts() {
    local planned=0
    if [ -f "$(_zerompi_ledger)" ]; then
        planned=$(grep -c "^${SLURM_JOB_ID:-?} " "$(_zerompi_ledger)")
    fi
    echo $(( ${SLURM_RESTART_COUNT:-0} - planned ))
}

_zerompi_on_usr1() {
    _zerompi_usr1=1
    zerompi_log "USR1 (time limit near): relaying to the ranks, which checkpoint and stop"
    if [ -n "$_zerompi_pid" ]; then
        kill -USR1 "$_zerompi_pid" 2>/dev/null
    fi
}

# zerompi_run CMD [ARGS...]: run CMD (an srun line) with USR1 relayed to it; its exit
# status ends up in ZEROMPI_RC. CMD runs in the background because bash runs a trap
# only between commands: a foreground srun would delay the relay until it had exited.
zerompi_run() {
    _zerompi_usr1=0
    _zerompi_pid=
    local failed
    failed=$(zerompi_failed_restarts)
    if [ "$failed" -gt "$MAX_RESTARTS" ]; then
        zerompi_log "not starting: $failed restarts after failures (MAX_RESTARTS=$MAX_RESTARTS);" \
                    "resubmit to continue from the checkpoint"
        exit 1
    fi
    # Only USR1: no TERM trap, so `scancel` ends the job instead of requeueing it.
    trap _zerompi_on_usr1 USR1
    zerompi_log "running: $*"
    "$@" &
    _zerompi_pid=$!
    # A signal that arrived before srun existed is passed on now.
    if [ "$_zerompi_usr1" = 1 ]; then
        kill -USR1 "$_zerompi_pid" 2>/dev/null
    fi
    # A trapped signal cuts `wait` short (status > 128) while srun runs on: wait until
    # it is really gone, then collect its status (bash keeps it for one more `wait`).
    while kill -0 "$_zerompi_pid" 2>/dev/null; do
        wait "$_zerompi_pid"
    done
    wait "$_zerompi_pid"
    ZEROMPI_RC=$?
    trap - USR1
    zerompi_log "srun exited with $ZEROMPI_RC (USR1 received: $_zerompi_usr1)"
}

# zerompi_requeue_or_exit RC: end the batch script. On the trainer's requeue code, put the
# job back in the queue (same job id, SLURM_RESTART_COUNT + 1, same --output log with
# --open-mode=append); the next run resumes from the run dir's newest checkpoint.
zerompi_requeue_or_exit() {
    local rc=$1 restart=${SLURM_RESTART_COUNT:-0}
    if [ "${SLURM_JOB_NUM_NODES:-1}" -gt 1 ]; then
        if [ "$rc" -eq "$ZEROMPI_LOST_EXIT" ]; then
            zerompi_await_node_verdict "ranks stopped answering (exit $ZEROMPI_LOST_EXIT, the watchdog line above names them)"
        elif [ "$rc" -ne 0 ] && [ "$rc" -ne "$ZEROMPI_REQUEUE_EXIT" ] && [ "${_zerompi_usr1:-0}" = 0 ]; then
            zerompi_silent_nodes "$rc"
        fi
    fi
    if [ "$rc" -eq "$ZEROMPI_REQUEUE_EXIT" ]; then
        # Logged first: the requeue can end this run before `scontrol` even returns.
        zerompi_log "checkpointed; requeueing"
        # a planned restart (time limit), not a failure: zerompi_failed_restarts
        echo "$SLURM_JOB_ID $((restart + 1))" >> "$(_zerompi_ledger)" || true
        if scontrol requeue "$SLURM_JOB_ID"; then
            exit 0
        fi
        zerompi_log "scontrol requeue failed (submitted without --requeue, or the site forbids it);" \
                    "resubmit to continue from the checkpoint"
    fi
    exit "$rc"
}

# zerompi_await_node_verdict: the ranks ended because peers stopped answering (exit 3). If
# a node of this job died, Slurm declares it down after SlurmdTimeout and, the job being
# --requeue, requeues it on the nodes left (this shell is then killed): keep the
# allocation until then, instead of ending as FAILED a moment before. If no node goes
# down within SlurmdTimeout + 30 s (LOST_NODE_WAIT), the ranks hung on live nodes: exit 3,
# since a requeue would only repeat the hang.
zerompi_await_node_verdict() {
    local why=$1 wait=${LOST_NODE_WAIT:-}
    if [ -z "$wait" ]; then
        wait=$(scontrol show config 2>/dev/null | awk '$1 == "SlurmdTimeout" {print $3 + 30}')
        wait=${wait:-330}
    fi
    zerompi_log "$why: waiting up to ${wait} s for Slurm to declare a node down and requeue this job"
    sleep "$wait"
    zerompi_log "no node of this job went down: the ranks hung on live nodes; not requeueing"
}

# zerompi_silent_nodes RC: the launcher ended the job with RC before any rank could speak
# (every process of a node killed while its kernel still answers: the survivors'
# connections are reset and hydra, or srun --kill-on-bad-exit, ends the job at once, in
# words that name no node). Ask every node of the job to run `true` (ZEROMPI_PROBE_S
# each, in parallel) and say which did not; if some did not, wait for Slurm's verdict as
# for exit 3. If all did, a process died on a live node: the launcher's lines above say
# which.
zerompi_silent_nodes() {
    local rc=$1 probe=${ZEROMPI_PROBE_S:-20} node silent=() probes=() i=0
    local nodes
    mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST" 2>/dev/null)
    [ "${#nodes[@]}" -gt 1 ] || return 0
    for node in "${nodes[@]}"; do
        timeout -k 2 "$probe" srun --overlap --nodes=1 --ntasks=1 --nodelist="$node" --quiet \
            --output=none --error=none true &
        probes+=($!)
    done
    for node in "${nodes[@]}"; do
        wait "${probes[$i]}" || silent+=("$node")
        i=$((i + 1))
    done
    if [ "${#silent[@]}" -eq 0 ]; then
        zerompi_log "the launcher ended the job (exit $rc); every node of the job answers: a process died" \
                    "on a live node (the launcher's lines above name it)"
        return 0
    fi
    local list
    list=$(IFS=,; echo "${silent[*]}")
    zerompi_await_node_verdict "the launcher ended the job (exit $rc); lost: node ${list} (${#silent[@]} of ${#nodes[@]} did not run a probe step within ${probe} s: processes killed or the node down)"
}
