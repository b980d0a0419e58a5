"""The run behind `python -m zerompi.train` (zerompi/train.py): the process grid, model,
engine, resume and the training loop, once train.py has agreed the config and the node
layout and its preflight (trainer/preflight.py) has checked the data. Importing this imports torch (the costliest part of a rank's start-up), which train.py
does only then.

run() returns the command's exit code (train.py lists them) or raises a JobError that
train.main turns into one line."""
from __future__ import annotations

import json
import math
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

import zerompi

from .. import runtime
from ..checkpoint.resume import resume
from ..config import to_dict
from ..data import TokenSampler
from ..data.check import CheckedSampler
from ..models import arch
from ..optim import decay_groups
from ..parallel.dims import ParallelDims
from ..runtime import watchdog
from ..runtime.console import say
from ..runtime.fileio import atomic_write
from .checkpoints import TrainCheckpoints, check_train_changes
from .compiling import compile_blocks
from .preflight import model_state
from .progress import Progress, batch_note, finish_message
from .schedule import lr_at, position

# train.py's (its docstring lists every exit code): repeated, not imported, so that
# train.py can import this module late without an import cycle
EXIT_OK, EXIT_USAGE, EXIT_STOPPED = 0, 2, 124
PROG = "zerompi.train"


@dataclass
class Run:
    """What the training loop works with, built once by run()."""
    cfg: object                 # the agreed TrainConfig
    engine: object
    dims: ParallelDims
    device: torch.device
    train_data: CheckedSampler
    val_data: CheckedSampler | None
    data_state: dict            # what the data order depends on (saved, compared on resume)
    model_state: dict           # the architecture record (saved, compared on resume)
    progress: Progress
    checkpoints: TrainCheckpoints
    ckpt_dir: Path
    start_step: int
    flops_per_token: float      # training FLOPs per token at the sequence length used
    peak: float                 # peak FLOP/s per rank that MFU is measured against


def _rss_bytes() -> int:
    """Current resident set size of this process."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource  # peak, not current, but better than nothing (macOS)

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


def _threads_per_rank(local_ranks: int) -> int:
    # srun --cpus-per-task binds each task already; an unbound mpiexec rank sees every core.
    if os.environ.get("SLURM_CPUS_PER_TASK"):
        return max(1, int(os.environ["SLURM_CPUS_PER_TASK"]))
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, usable // local_ranks if usable == os.cpu_count() else usable)


def _trim_metrics(path: Path, upto: int, saved: dict | None = None) -> None:
    """Keep the lines of steps <= `upto` (a resumed run redoes the later ones). `saved` is
    the checkpoint's own copy of step `upto`'s line: written back when a kill between the
    checkpoint's publication and that line lost it (without its "checkpoints" entry)."""
    if not path.exists() and saved is None:
        return
    keep, have = [], set()
    for line in (path.read_text().splitlines() if path.exists() else []):
        try:
            step = json.loads(line)["step"]
        except (ValueError, KeyError, TypeError):
            continue  # a line cut short by a kill
        if step <= upto:
            keep.append(line)
            have.add(step)
    if saved is not None and saved.get("step") == upto and upto not in have:
        keep.append(json.dumps(saved))
    atomic_write(path, "".join(k + "\n" for k in keep))


def evaluate(engine, val_data, cfg, dims, device) -> float:
    """Mean validation loss over eval_batches x global_batch sequences, all ranks."""
    B, G, r, n = cfg.global_batch, engine.gradient_accumulation_steps, dims.dp_rank, dims.dp_size
    engine.eval()
    loss_sum, rows_sum = 0.0, 0
    with torch.no_grad():
        for b in range(min(cfg.eval_batches, val_data.num_eval_batches(B))):
            for m in range(G):
                rows = TokenSampler.rows(m, r, n, B, G)
                # A rank with no rows still runs a forward (stage 3 gathers parameters
                # in it), on one borrowed row that is weighted 0.
                at = (b, r, n, B, m, G) if rows else (b, 0, 1, 1)
                x, y = val_data.eval_batch(*at)
                docs = {"doc_ids": val_data.eval_doc_ids(*at).to(device)} if cfg.doc_mask else {}
                _, loss = engine(x.to(device), y.to(device), **docs)
                loss_sum += loss.item() * rows  # sync: host waits for the device (GPU)
                rows_sum += rows
    engine.train()
    # sync: collective over dp, where the batch is split. Ranks hold different numbers of
    # rows: divide the sum of row-weighted losses by the rows.
    loss_total, rows_total = dims.dp.allreduce_scalars([loss_sum, float(rows_sum)])
    return loss_total / rows_total


def run(cfg, nodes, pre) -> int:
    """Train as `cfg` (a TrainConfig every rank agreed on, device resolved) says, on the
    ranks `nodes` (parallel/nodes.py) describes, with what train.py's preflight settled
    (`pre`: the run directory's lock, the checked data; trainer/preflight.py)."""
    # ---------------------------------------------------------------- process grid
    local_rank, local_ranks = nodes.local_rank, nodes.per_node
    device = torch.device("cpu")
    if cfg.device == "cuda":  # visible on every rank: checked with the config
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    # sync: communicators for where the tensors live (NCCL / device MPI on GPUs)
    dims = ParallelDims.from_config(cfg.zero, device=device if device.type == "cuda" else None, nodes=nodes)
    threads = cfg.threads or _threads_per_rank(local_ranks)
    torch.set_num_threads(threads)

    # ---------------------------------------------------------------- data (checked in preflight)
    T, B, V = cfg.seq_len, cfg.global_batch, cfg.model.shape().vocab_size
    data, spec, data_state, lock = pre.data, pre.spec, pre.data_state, pre.lock
    train_tokens, val_tokens = data.train.tokens, data.val.tokens
    train_data = CheckedSampler(train_tokens, T, seed=cfg.seed, vocab_size=V, spec=spec, order=cfg.data_order,
                                doc_starts=data.train.doc_starts if cfg.doc_mask else None)
    val_data = CheckedSampler(val_tokens, T, seed=cfg.seed, vocab_size=V, spec=cfg.data_val or spec,
                              doc_starts=data.val.doc_starts if cfg.doc_mask else None) if cfg.eval_interval else None

    # ---------------------------------------------------------------- model and engine
    shape, family = cfg.model.shape(), cfg.model.kind
    if cfg.init_from and cfg.zero.stage == 3 and dims.tp_size == 1:
        # the weights come from the file: build partitioned, never the whole random model
        with zerompi.Init(cfg.zero, dims=dims, seed=cfg.seed):
            model = arch.build(shape)
    else:
        torch.manual_seed(cfg.seed)  # rank 0's init is broadcast by the engine anyway
        model = arch.build(shape)
    n_total = arch.num_params(shape)  # the whole model's, whatever the tp split or stage
    if dims.tp_size > 1:
        from ..parallel.parallelize import parallelize

        model = parallelize(model, dims.tp)  # each rank keeps its slices of the full weights
    model.to(device)
    if cfg.compile:  # per block, before the engine's hooks exist (trainer/compiling.py)
        compile_blocks(model, cfg.compile_backend)
    # Biases and norm weights get no weight decay (the usual GPT recipe).
    groups = decay_groups(model, cfg.zero.optimizer.weight_decay)
    engine = zerompi.initialize(model, cfg.zero, dims=dims, param_groups=groups)
    G = engine.gradient_accumulation_steps
    flops_per_token = arch.flops_per_token(shape, T)  # whole model, at the sequence length used
    peak = cfg.peak_flops or threads * 100e9
    mfu_label = "mfu" if cfg.peak_flops else "mfu~"  # "~": against a guessed CPU peak

    # ---------------------------------------------------------------- resume
    run_dir = Path(cfg.run_dir)
    ckpt_dir, metrics_path = run_dir / "checkpoints", run_dir / "metrics.jsonl"
    # sync: collective; rank 0 picks (latest, else the newest that verifies), None = fresh start.
    client = resume(engine, dims.world, ckpt_dir, cfg.resume_from, cfg.override_optimizer) if cfg.resume else None
    check_train_changes(dims.world, client, to_dict(cfg), model_state(shape), data_state,  # sync
                        {"micro_steps": G, "eval_batches": val_data.num_eval_batches(B) if val_data else 0})
    start_step = int(client["step"]) if client else 0
    if cfg.init_from and client is None:  # sync: collective; a resumed run has its own weights
        _init_from(engine, cfg, family, dims)
    # the epoch walk goes on where the checkpoint left it (older checkpoints: step x batch)
    train_data.resume_at(start_step, int(client.get("data_position", start_step * B)) if client else 0)

    if dims.rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write(run_dir / "config.json", json.dumps(to_dict(cfg), indent=1) + "\n")
        _trim_metrics(metrics_path, start_step, client.get("metrics") if client else None)
        _info(f"{n_total / 1e6:.2f}M-parameter {'Llama' if family == 'llama' else 'GPT'} "
              f"({cfg.init_from or cfg.model.config or cfg.model.preset}), "
              f"{dims.world.size} ranks x {threads} threads"
              + (f" (dp {dims.dp_size} x tp {dims.tp_size})" if dims.tp_size > 1 else "")
              + f", ZeRO stage {cfg.zero.stage} "
              f"{cfg.zero.precision}, {B} seqs x {T} tokens per step ({G} micro-steps), "
              + (f"blocks compiled ({cfg.compile_backend}), " if cfg.compile else "") +
              f"{len(train_tokens):,} train / {len(val_tokens):,} val tokens"
              + (f"; epoch order: {train_data.num_windows():,} windows, {train_data.num_windows() / B:.1f} steps "
                 "per epoch" if cfg.data_order == "epoch" else "")
              + ("; no attention across documents (doc_mask)" if cfg.doc_mask else ""))
        _info(f"run_dir {run_dir}; "
              + (f"resumed at step {start_step}" if start_step else "starting at step 0")
              + ("" if cfg.peak_flops else f"; MFU~ against an assumed CPU peak of {peak / 1e9:.0f} "
                 "GFLOP/s per rank (set peak_flops)"))
        note = batch_note(B, G, dims.dp_size)
        if note:
            _info(note)
    dims.world.barrier()  # sync: run_dir exists before anyone writes to it
    progress = Progress(cfg, metrics_path, start_step, mfu_label, active=dims.rank == 0)
    checkpoints = TrainCheckpoints(engine, ckpt_dir, cfg, progress.note)
    try:
        # The steps raise a JobError (a diverged run) on every rank together: the ranks still
        # talk, so the background save in flight (of a good step) is finished and published.
        # Any other exception ends the job without a collective; that save is never published.
        code = _loop(Run(cfg, engine, dims, device, train_data, val_data, data_state, model_state(shape),
                         progress, checkpoints, ckpt_dir, start_step, flops_per_token, peak))
    except runtime.JobError:
        checkpoints.flush()
        raise
    if code == EXIT_STOPPED:  # leave together: srun --kill-on-bad-exit would kill a late rank
        runtime.exit_together(code, dims.world, before=[lock.release] if lock else [],
                              stop_mpi_users=[watchdog.close])
    return code


def _info(line: str) -> None:
    """A line of the run's header on stdout; its callers are rank 0's."""
    say(line, rank=0, prog=PROG, err=False)


def _init_from(engine, cfg, family: str, dims) -> None:
    """The weights of the HF checkpoint cfg.init_from, streamed into the engine."""
    from ..models.hf_names import gpt_activation_note
    from ..models.hf_weights import load_hf
    from ..models.llama_config import read_hf_config

    t0 = time.perf_counter()
    try:
        load_hf(engine, cfg.init_from, family)
    except ValueError as e:  # raised by every rank together (agreed in load_hf / load_full)
        err = runtime.JobError(str(e))
        err.exit_code = EXIT_USAGE
        raise err from None
    if dims.rank == 0:
        note = gpt_activation_note(read_hf_config(cfg.init_from)) if family == "gpt" else None
        _info(f"weights from {cfg.init_from} ({time.perf_counter() - t0:.1f} s)" + (f"; note: {note}" if note else ""))


def _loop(run: Run) -> int:
    cfg, engine, dims, device, progress, checkpoints = (run.cfg, run.engine, run.dims, run.device,
                                                        run.progress, run.checkpoints)
    train_data, start_step = run.train_data, run.start_step
    B, T, G = cfg.global_batch, cfg.seq_len, engine.gradient_accumulation_steps
    engine.train()
    t_start = time.perf_counter()
    for step in range(start_step, cfg.max_steps):
        lr = lr_at(position(cfg, step, engine.global_steps), cfg)  # deepspeed_*: applied updates
        for group in engine.param_groups:
            group["lr"] = lr
        t0 = time.perf_counter()
        loss_sum = 0.0  # sum over this rank's sequences of their mean token loss
        for m in range(G):
            rows = TokenSampler.rows(m, dims.dp_rank, dims.dp_size, B, G)
            # Per-(step, micro, dp rank) seed: dropout is reproducible and needs no RNG
            # state in checkpoints, so a resumed run repeats an uninterrupted one exactly.
            torch.manual_seed(int(np.random.SeedSequence([cfg.zero.seed, step, m, dims.dp_rank])
                                  .generate_state(1)[0]))
            at = (step, m, dims.dp_rank, dims.dp_size, B, G) if rows else (step, 0, 0, 1, 1)
            x, y = train_data.batch(*at)
            docs = {"doc_ids": train_data.doc_ids(*at).to(device)} if cfg.doc_mask else {}
            _, loss = engine(x.to(device), y.to(device), **docs)
            # Exact global mean with uneven rows: the engine averages the D*G (dp rank,
            # micro-step) gradients, so a mean loss scaled by rows*D*G/B gives the gradient of
            # the mean over all B rows. A rank with 0 rows adds 0 but joins the reduction.
            # sync: backward() returns once its gradients are reduced over dims.dp (every
            # micro-step at stages 2-3, the last at 0-1); at the boundary step() all-reduces
            # the gradient norm and, at stages 1-2, all-gathers the updated parameters.
            engine.backward(loss * (rows * dims.dp_size * G / B))
            updated = engine.step()
            loss_sum += loss.item() * rows  # sync: host waits for the device (GPU)
        # sync: two collectives once per step. SUM over dp gives the loss over all B rows;
        # MAX over the world makes one rank's stop signal everyone's, so all checkpoint
        # and exit together.
        (total,) = dims.dp.allreduce_scalars([loss_sum])
        sig, rss = dims.world.allreduce_scalars([float(watchdog.stop_signal()), float(_rss_bytes())], op="max")
        if sig:
            watchdog.stop_agreed()  # the ranks still talk: checkpoint with normal deadlines
        dt = time.perf_counter() - t0
        done = step + 1  # steps completed; metrics and checkpoints are keyed by it
        last = done == cfg.max_steps

        record = {"step": done, "loss": total / B, "lr": lr,
                  "grad_norm": engine.last_grad_norm, "loss_scale": engine.loss_scale,
                  # a step decided on the device (defer_stats) says at once only that it was issued
                  "updated": bool(updated) and math.isfinite(engine.last_grad_norm),
                  "tokens": done * B * T, "tokens_per_s": B * T / dt,
                  "step_time": dt, "mfu": run.flops_per_token * B * T / dt / (run.peak * dims.world.size),
                  "rss": int(rss), "model_state_bytes": engine.memory_report()["model_states"],
                  # epochs completed (fraction) of the epoch order's walk
                  **({"epoch": train_data.position(done, B) / train_data.num_windows()}
                     if cfg.data_order == "epoch" else {}),
                  "time": time.perf_counter() - t_start}
        # the offloaded optimizer's phases (docs/offload.md), flat: offload_host_pass, ...
        record.update({f"offload_{k}": v for k, v in engine.offload_phases.items()})
        if cfg.eval_interval and (done % cfg.eval_interval == 0 or last):
            record["val_loss"] = evaluate(engine, run.val_data, cfg, dims, device)

        checkpoints.poll()  # sync (while a save is in flight): publish it once every rank wrote
        if sig or last or (cfg.checkpoint_interval and done % cfg.checkpoint_interval == 0):
            if engine.nonfinite.streak:  # the same on every rank: never save past the last finite step
                say(f"step {done} was not finite: no checkpoint", rank=dims.rank, prog=PROG)
            else:  # sync: collective. The sampler is a pure function of (seed, step, data_position)
                # "metrics": this step's line, which a kill right after the save would lose
                checkpoints.save(done, {"step": done, "tokens": done * B * T, "data": run.data_state,
                                        "data_position": train_data.position(done, B),
                                        "model": run.model_state, "config": to_dict(cfg),
                                        "metrics": dict(record)}, final=bool(sig or last))
        saved = checkpoints.take()
        if saved:
            record["checkpoints"] = saved
        progress.update(record)
        if sig and not last:
            progress.close(f"{signal.Signals(int(sig)).name} received: checkpoint of step {done} "
                           f"saved in {run.ckpt_dir}; exiting with {EXIT_STOPPED} (requeue me)")
            return EXIT_STOPPED

    checkpoints.flush()  # sync: a background save still in flight (the last step was not finite)
    progress.close(finish_message(cfg.max_steps, start_step, time.perf_counter() - t_start))
    return EXIT_OK
