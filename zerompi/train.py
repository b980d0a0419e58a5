"""Train a GPT with ZeRO over MPI: `python -m zerompi.train` (the run itself: trainer/loop.py).

Workstation (2 ranks, the tiny model on the built-in corpus, a few minutes on a laptop):

    mpiexec -n 2 python -m zerompi.train --config configs/tiny.toml

Slurm (inside an sbatch script; one task per rank, or per GPU; slurm/*.sbatch do this):

    srun --mpi=pmi2 --kill-on-bad-exit=1 python -m zerompi.train --config configs/small.toml

(--run_dir: the templates pass runs/$SLURM_JOB_NAME, so a requeued or resubmitted job
resumes its run.)

--mpi=pmi2 is what pip's MPICH speaks (a site MPI built with PMIx: --mpi=pmix); across
nodes pip's MPICH can hang in MPI_Init under srun: start it with MPICH's own
`mpiexec -bootstrap slurm -n $SLURM_NTASKS python -m zerompi.train ...` instead.
--kill-on-bad-exit=1 ends every rank when one dies. MPI_Init has a deadline
(ZEROMPI_STARTUP_TIMEOUT_S, else zero.comm.startup_timeout_s): past it, one line names
the launcher and the MPI library seen, and the rank is killed (SIGKILL: 137 in a shell).

Settings are TrainConfig fields (zerompi/trainer/config.py; `--help` lists them all):
`--config FILE` (TOML or JSON), then `--key value` or `key=value` overrides, dotted for
nested tables: `--max_steps 50 zero.stage=2 --zero.optimizer.lr 3e-4`. A DeepSpeed
config works too: `--deepspeed_config ds_config.json` (docs/migrating-from-deepspeed.md).

Outputs in run_dir: config.json, metrics.jsonl (one JSON object per step; plot it with
`python -m zerompi.plot RUN_DIR`), checkpoints/ (every checkpoint_interval steps, at the
end and on a stop signal). Restarting with the same run_dir resumes from the latest
checkpoint, so re-running the same command is always safe.

Exit codes:
    0    finished max_steps (or nothing left to do)
    2    bad command line or config (message names the key; no rank hangs), or a resume
         or data set that does not fit (docs/reliability.md), or nodes that hold different
         numbers of ranks (parallel/nodes.py), or a launch of N tasks that MPI made N
         worlds of 1 (srun --mpi=none, another MPI's mpiexec: runtime/startup.py)
    124  stopped by SIGUSR1, SIGTERM or a first SIGINT after writing a checkpoint: requeue
         the job, as slurm/*.sbatch do: `#SBATCH --signal=B:USR1@120` signals the batch
         shell, which relays USR1 to srun (slurm/_requeue.sh) and runs `scontrol requeue` on 124
    3    a collective wait passed zero.comm.timeout_s (the ranks that did not arrive named)
    4    diverged: zero.max_nonfinite_steps non-finite steps in a row (no checkpoint of them)
    5    run_dir is in use by another job (named)
    128+N  signal N while a rank was blocked, or a second SIGINT: no checkpoint;
         137 (SIGKILL) also when MPI did not start within its deadline (the line above it)
    1    anything else (one rank's exception aborts the whole job, see runtime/abort.py)
"""
from __future__ import annotations

import dataclasses
import sys

from . import runtime
from .config import ConfigError, to_dict
from .trainer import config as train_config
from .trainer.preflight import preflight
from .parallel.nodes import discover as discover_nodes
from .runtime import pygc, startup, watchdog
from .runtime.agree import ObjectComm
from .runtime.console import say

EXIT_OK, EXIT_USAGE = 0, 2
PROG = "zerompi.train"
# Run as the command (not main() called from a caller's process): the collector's pause
# and the frozen start-up heap (runtime/pygc.py) are the command's own.
_COMMAND = __name__ == "__main__"


def _agreed(world, error, what: str, value) -> bool:
    """Collective: True when no rank failed (`error`: its exception or message, or None)
    and every rank holds rank 0's `value`; otherwise rank 0 prints the job's one error line,
    naming the first rank that failed or differs (runtime.agree, runtime.same_everywhere)."""
    errors = runtime.agree(world, error)
    if not errors:  # the same answer on every rank: all of them compare, or none
        errors = [(0, "", m) for m in runtime.same_everywhere(world, value, what)]
    if errors:
        r, _, msg = errors[0]
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        say(f"error{f' on rank {r}' if r else ''}: {msg}{more}", rank=world.rank, prog=PROG)
    return not errors


def _agreed_config(argv: list[str], world):
    """The TrainConfig, or None once rank 0 printed the job's one error line. Every rank
    parses and checks for itself, then the ranks agree, so a rank that failed alone (or
    read another file than rank 0) never leaves the others in a collective.
    No torch here: a typo ends a job of any size before its ranks import it."""
    cfg, error = None, None
    try:
        cfg = train_config.from_argv(argv)
        tp = cfg.zero.tensor_parallel_size
        if world.size % tp:
            raise ConfigError("zero.tensor_parallel_size", tp, f"must divide the number of ranks ({world.size})")
        problem = cfg.model.shape().tp_problem(tp)
        if problem:
            raise ConfigError("zero.tensor_parallel_size", tp, problem)
    except ValueError as e:
        error = e
    return cfg if _agreed(world, error, "config", to_dict(cfg) if cfg else None) else None


def _peek_startup_timeout(argv: list[str]) -> float | None:
    try:
        return float(train_config.peek(argv, "zero.comm.startup_timeout_s"))
    except Exception:  # noqa: BLE001  unreadable here: the ranks agree on the error after MPI starts
        return None


def _layout_error(cfg, nodes, ranks: int) -> ConfigError | None:
    """What the world size and node layout refuse in cfg.zero (zero.shard_group,
    zero.comm.hierarchical, zero.stage3.secondary_partition: zero/groups.decide, pure, on
    each data-parallel group's node map) or in the hardware (zero.comm.backend "nccl"
    without CUDA tensors or cupy): the engine's own checks, before torch is imported."""
    import importlib.util

    from .zero import groups

    z, tp = cfg.zero, cfg.zero.tensor_parallel_size
    try:
        for c in range(tp):  # data-parallel group c: world ranks c, c + tp, ... (parallel/dims.py)
            seen: dict[int, int] = {}
            dp_nodes = [seen.setdefault(nodes.node_of(r), len(seen)) for r in range(c, ranks, tp)]
            groups.decide(dp_nodes, z.shard_group, z.comm.hierarchical, z.stage3.secondary_partition, z.stage)
    except ConfigError as e:
        return e.under("zero")
    if z.comm.backend == "nccl":
        why = "NCCL needs CUDA tensors, but device is cpu" if cfg.device == "cpu" else \
            None if importlib.util.find_spec("cupy") else "cupy is not installed (pip install -e .[cuda12] or .[cuda13])"
        if why:
            return ConfigError("zero.comm.backend", "nccl", f"{why}; use 'mpi' or 'auto'")
    return None


def zero_key(e: ConfigError) -> ConfigError:
    """`e` naming its key as typed on the command line: the engine's keys (ZeroConfig's)
    under `zero.`, the trainer's as they are."""
    top = e.key.split(".", 1)[0]
    return e if top in _TRAIN_KEYS and top not in _ZERO_KEYS else e.under("zero")


_TRAIN_KEYS = {f.name for f in dataclasses.fields(train_config.TrainConfig)}
_ZERO_KEYS = {f.name for f in dataclasses.fields(train_config.ZeroConfig)}


def _agreed_device(cfg, world):
    """`cfg` with device "auto" resolved (cuda where torch sees a GPU), the same on every
    rank, or None once rank 0 printed the job's one error line."""
    import torch

    device, error = cfg.device, None
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device == "cuda" and not torch.cuda.is_available():
        error = ConfigError("device", "cuda", "no CUDA device visible to this rank")
    if error is None and cfg.zero.comm.backend == "nccl":  # cupy was found; can it serve this device?
        from .comm import nccl

        why = nccl.unavailable(device)
        error = ConfigError("zero.comm.backend", "nccl", f"{why}; use 'mpi' or 'auto'") if why else None
    return dataclasses.replace(cfg, device=device) if _agreed(world, error, "device", {"device": device}) else None


@runtime.one_line_job_errors(PROG)  # diverged, busy run_dir, resume that does not fit, uneven nodes
def main(argv: list[str] | None = None) -> int:
    # SIGUSR1/SIGTERM/SIGINT set a flag the loop acts on between steps, on every rank
    # together; a rank blocked in a collective is ended by the watchdog instead.
    watchdog.install_stop_signals()
    argv = sys.argv[1:] if argv is None else list(argv)
    if "-h" in argv or "--help" in argv:
        print(__doc__)
        print("Keys and defaults:\n" + "\n".join(train_config.describe()))
        return EXIT_OK

    # MPI starts under a deadline (runtime/startup.py): the config's, read without checks
    # (what is wrong with it is agreed once the ranks can talk), or the launch's.
    try:
        startup.import_mpi(_peek_startup_timeout(argv))
    except ValueError as e:  # a bad ZEROMPI_STARTUP_TIMEOUT_S, in every process's environment
        say(f"error: {e}", rank=startup.env_rank() or 0, prog=PROG)
        return EXIT_USAGE
    # Config and node layout first, agreed by all ranks over bare MPI: what is wrong with
    # them ends the job before any rank imports torch.
    world = runtime.init()  # a launch of N tasks that became N worlds of 1 ends here (exit 2)
    setup = ObjectComm(world)
    cfg = _agreed_config(argv, setup)
    if cfg is None:
        return EXIT_USAGE
    # sync: which ranks share a node; an uneven layout ends the job here (one line, exit 2)
    nodes = discover_nodes(world)
    if not _agreed(setup, _layout_error(cfg, nodes, world.size), "layout", None):
        return EXIT_USAGE

    # The data and the resume's architecture, still without torch (trainer/preflight.py).
    pre = preflight(cfg, nodes, setup)
    if pre is None:
        return EXIT_USAGE

    if _COMMAND:
        pygc.pause_collector()  # import torch runs ~370 collections otherwise
    from .trainer import loop  # torch, the model, the engine

    if _COMMAND:
        runtime.freeze_startup_heap()  # what the imports built, out of the collector's view
    cfg = _agreed_device(cfg, setup)
    if cfg is None:
        return EXIT_USAGE
    pre.claim(cfg, nodes, setup)  # run_dir, once nothing in the config is wrong; raises if busy
    try:
        return loop.run(cfg, nodes, pre)
    except ConfigError as e:  # a check the agreed ones above do not make: named as typed, then
        raise zero_key(e) from None  # one line from rank 0 and exit 2 (runtime/abort.py)


if __name__ == "__main__":
    sys.exit(main())
