"""Train a GPT with ZeRO over MPI: `python -m zerompi.train`, one loop, top to bottom.

Workstation (2 ranks, the tiny model on the built-in corpus, a few minutes on a laptop):

    mpiexec -n 2 python -m zerompi.train --config configs/tiny.toml

Slurm (inside an sbatch script; one task per rank, or per GPU):

    srun python -m zerompi.train --config configs/small.toml --run_dir runs/$SLURM_JOB_ID

Settings are TrainConfig fields (zerompi/train_config.py; `--help` lists them all):
`--config FILE` (TOML or JSON), then `--key value` or `key=value` overrides, dotted for
nested tables: `--max_steps 50 zero.stage=2 --zero.optimizer.lr 3e-4`.

Outputs in run_dir: config.json, metrics.jsonl (one JSON object per step; plot it with
`python -m zerompi.plot RUN_DIR`), checkpoints/ (every checkpoint_interval steps, at the
end and on a stop signal). Restarting with the same run_dir resumes from the latest
checkpoint, so re-running the same command is always safe.

Exit codes:
    0    finished max_steps (or nothing left to do)
    2    bad command line or config (message names the key; no rank hangs)
    124  stopped by SIGUSR1 or SIGTERM after writing a checkpoint: requeue the job,
         e.g. `#SBATCH --signal=USR1@120` plus, in the batch script,
         `srun ... ; [ $? -eq 124 ] && scontrol requeue $SLURM_JOB_ID`
    1    anything else (one rank's exception aborts the whole job, see runtime.py)
"""
from __future__ import annotations

import json
import math
import os
import signal
import sys
import time
from pathlib import Path

EXIT_OK, EXIT_USAGE, EXIT_STOPPED = 0, 2, 124

# Set by SIGUSR1/SIGTERM. The handler does nothing else: MPI and torch are not
# async-signal-safe, so the loop acts on the flag between steps, on every rank together.
_stop_signal = 0


def _on_signal(signum, frame) -> None:
    global _stop_signal
    _stop_signal = signum


def lr_at(step: int, cfg) -> float:
    """Linear warm-up to zero.optimizer.lr, then cosine down to min_lr."""
    peak, warmup = cfg.zero.optimizer.lr, cfg.warmup_steps
    if step < warmup:
        return peak * (step + 1) / warmup
    end = cfg.lr_decay_steps or cfg.max_steps
    if step >= end:
        return cfg.min_lr
    frac = (step - warmup) / max(1, end - warmup)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * frac)) * (peak - cfg.min_lr)


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


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f}{unit}" if unit in ("B", "KB") else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n:.1f}GB"


def _trim_metrics(path: Path, upto: int) -> None:
    """Drop lines past step `upto`: a resumed run redoes those steps."""
    if not path.exists():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= upto:
                keep.append(line)
        except (ValueError, KeyError, TypeError):
            pass  # a line cut short by a kill
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(k + "\n" for k in keep))
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGUSR1, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    argv = sys.argv[1:] if argv is None else list(argv)
    from . import train_config

    if "-h" in argv or "--help" in argv:
        print(__doc__)
        print("Keys and defaults:\n" + "\n".join(train_config.describe()))
        return EXIT_OK

    # ---------------------------------------------------------------- config, agreed by all ranks
    from . import runtime

    world = runtime.init().Dup()  # private communicator for the loop's own small reductions
    rank = world.Get_rank()
    try:
        cfg, error = train_config.from_argv(argv), None
    except ValueError as e:
        cfg, error = None, str(e)
    # Every rank parses for itself; exchanging the outcome means a rank that failed (or
    # read a different file) cannot leave the others waiting in a collective.
    outcomes = world.allgather((error, train_config.to_dict(cfg) if cfg else None))
    errors = [(r, e) for r, (e, _) in enumerate(outcomes) if e]
    if not errors and any(d != outcomes[0][1] for _, d in outcomes):
        errors = [(next(r for r, (_, d) in enumerate(outcomes) if d != outcomes[0][1]),
                   "this rank's config differs from rank 0's (same file and arguments everywhere?)")]
    if errors:
        if rank == 0:
            r, e = errors[0]
            print(f"zerompi.train: error{f' on rank {r}' if r else ''}: {e}", file=sys.stderr, flush=True)
        return EXIT_USAGE

    import numpy as np
    import torch

    import zerompi
    from .data import TokenSampler, default_corpus, open_tokens, split_tokens
    from .models.gpt import GPT
    from .optim import decay_groups

    local_rank, local_ranks = runtime.local_rank(world)
    threads = cfg.threads or _threads_per_rank(local_ranks)
    torch.set_num_threads(threads)

    # ---------------------------------------------------------------- data
    if cfg.data == "default":
        if rank == 0:
            default_corpus()  # build the cache once, not on every rank at the same time
        world.Barrier()
    train_tokens, val_tokens = split_tokens(open_tokens(cfg.data), cfg.val_fraction)
    T, B = cfg.seq_len, cfg.global_batch
    train_data = TokenSampler(train_tokens, T, seed=cfg.seed)
    val_data = TokenSampler(val_tokens, T, seed=cfg.seed) if cfg.eval_interval else None

    # ---------------------------------------------------------------- model and engine
    gpt_cfg = cfg.model.gpt_config()
    torch.manual_seed(cfg.seed)  # rank 0's init is broadcast by the engine anyway
    model = GPT(gpt_cfg)
    device = torch.device("cpu")
    if cfg.device == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("config key 'device' = 'cuda': no CUDA device visible to this rank")
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        model.to(device)
    # Biases and norm weights get no weight decay (the usual GPT recipe).
    groups = decay_groups(model, cfg.zero.optimizer.weight_decay)
    engine = zerompi.initialize(model, cfg.zero, param_groups=groups)
    R, W, G = engine.rank, engine.world, engine.gradient_accumulation_steps
    n_params = model.num_params()
    # Training FLOPs per token as GPT.flops_per_token, at the sequence length actually used.
    flops_per_token = 6 * model.num_params(non_embedding=True) + 12 * gpt_cfg.n_layer * gpt_cfg.n_embd * T
    peak = cfg.peak_flops or threads * 100e9
    # "mfu~" marks an estimate against a guessed CPU peak rather than a known one.
    mfu_label = "mfu" if cfg.peak_flops else "mfu~"
    peak_note = "" if cfg.peak_flops else \
        f"~ against an assumed CPU peak of {peak / 1e9:.0f} GFLOP/s per rank (set peak_flops)"

    # ---------------------------------------------------------------- resume
    run_dir = Path(cfg.run_dir)
    ckpt_dir = run_dir / "checkpoints"
    metrics_path = run_dir / "metrics.jsonl"
    start_step = 0
    if cfg.resume and ckpt_dir.is_dir():
        client = engine.load_checkpoint(ckpt_dir)  # None when the folder holds none; raises if corrupt
        if client is not None:
            start_step = int(client["step"])
            saved = client.get("data", {})
            now = {"spec": cfg.data, "seed": cfg.seed, "global_batch": B, "block_size": T}
            changed = [k for k in now if k in saved and saved[k] != now[k]]
            if changed and rank == 0:
                print(f"warning: resuming with different {', '.join(changed)} than the checkpoint: "
                      "the data order will not match an uninterrupted run", file=sys.stderr)
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.json").write_text(json.dumps(train_config.to_dict(cfg), indent=1) + "\n")
        _trim_metrics(metrics_path, start_step)
        print(f"zerompi.train: {n_params / 1e6:.2f}M-parameter GPT ({cfg.model.preset}), {W} ranks x "
              f"{threads} threads, ZeRO stage {cfg.zero.stage} {cfg.zero.precision}, "
              f"{B} seqs x {T} tokens per step ({G} micro-steps), "
              f"{len(train_tokens):,} train / {len(val_tokens):,} val tokens", flush=True)
        print(f"zerompi.train: run_dir {run_dir}; "
              + (f"resumed at step {start_step}" if start_step else "starting at step 0")
              + (f"; MFU{peak_note}" if peak_note else ""), flush=True)
    world.Barrier()  # run_dir exists before anyone writes to it
    metrics = open(metrics_path, "a", buffering=1) if rank == 0 else None

    def save(step: int) -> None:
        # The sampler is a pure function of (seed, step), so the step *is* the data
        # position; keep_last rotates old checkpoints once the new one is in place.
        engine.save_checkpoint(ckpt_dir, tag=f"step_{step:07d}", keep_last=cfg.keep_last or None,
                               client_state={
                                   "step": step, "tokens": step * B * T,
                                   "data": {"spec": cfg.data, "seed": cfg.seed, "global_batch": B,
                                            "block_size": T},
                                   "config": train_config.to_dict(cfg)})

    def rows_of(micro: int) -> int:
        return TokenSampler.rows(micro, R, W, B, G)

    def evaluate() -> float:
        """Mean validation loss over eval_batches x global_batch sequences, all ranks."""
        n_batches = min(cfg.eval_batches, val_data.num_eval_batches(B))
        engine.eval()
        loss_sum, rows_sum = 0.0, 0
        with torch.no_grad():
            for b in range(n_batches):
                for m in range(G):
                    rows = rows_of(m)
                    # A rank with no rows still runs a forward (stage 3 gathers parameters
                    # in it), on one borrowed row that is weighted 0.
                    x, y = val_data.eval_batch(b, R, W, B, m, G) if rows else val_data.eval_batch(b, 0, 1, 1)
                    _, loss = engine(x.to(device), y.to(device))
                    loss_sum += loss.item() * rows
                    rows_sum += rows
        engine.train()
        # Ranks hold different numbers of rows: sum row-weighted losses, then divide by rows.
        total = np.array([loss_sum, float(rows_sum)])
        world.Allreduce(runtime.mpi().IN_PLACE, total, op=runtime.mpi().SUM)
        return float(total[0] / total[1])

    # ---------------------------------------------------------------- the loop
    bar = None
    show = cfg.progress if cfg.progress != "auto" else ("bar" if sys.stderr.isatty() else "lines")
    if rank == 0 and show == "bar":
        from tqdm import tqdm

        bar = tqdm(total=cfg.max_steps, initial=start_step, unit="step", dynamic_ncols=True)
    engine.train()
    t_start = time.perf_counter()
    for step in range(start_step, cfg.max_steps):
        lr = lr_at(step, cfg)
        for group in engine.param_groups:
            group["lr"] = lr
        t0 = time.perf_counter()
        loss_sum = 0.0  # sum over this rank's sequences of their mean token loss
        for m in range(G):
            rows = rows_of(m)
            # Per-(step, micro, rank) seed: dropout is reproducible and needs no RNG state
            # in checkpoints, so a resumed run repeats an uninterrupted one exactly.
            torch.manual_seed(int(np.random.SeedSequence([cfg.zero.seed, step, m, R]).generate_state(1)[0]))
            x, y = train_data.batch(step, m, R, W, B, G) if rows else train_data.batch(step, 0, 0, 1, 1)
            _, loss = engine(x.to(device), y.to(device))
            # Exact global mean with uneven rows: the engine sums the ranks' and micro-steps'
            # gradients and divides by W*G, giving (1/(W*G)) sum_{m,r} grad(L_mr). We want
            # grad of (1/B) sum over all B rows = (1/B) sum_{m,r} rows_mr * grad(mean_mr), so
            # L_mr = mean_mr * rows_mr * W * G / B (= rows * W / rows_in_micro_batch when G
            # divides B). A rank with 0 rows contributes 0 but still joins the reduction.
            engine.backward(loss * (rows * W * G / B))
            updated = engine.step()
            loss_sum += loss.item() * rows
        # One SUM for the loss, one MAX for the stop flag and memory: every rank sees the
        # same values, so all of them checkpoint and exit together.
        MPI = runtime.mpi()
        total = np.array([loss_sum])
        world.Allreduce(MPI.IN_PLACE, total, op=MPI.SUM)
        flags = np.array([float(_stop_signal), float(_rss_bytes())])
        world.Allreduce(MPI.IN_PLACE, flags, op=MPI.MAX)
        stop, rss = flags[0] > 0, flags[1]
        dt = time.perf_counter() - t0
        done = step + 1  # steps completed; metrics and checkpoints are keyed by it
        last = done == cfg.max_steps

        record = {"step": done, "loss": float(total[0] / B), "lr": lr, "grad_norm": engine.last_grad_norm,
                  "loss_scale": engine.loss_scale, "updated": bool(updated), "tokens": done * B * T,
                  "tokens_per_s": B * T / dt, "step_time": dt,
                  "mfu": flops_per_token * B * T / dt / (peak * W), "rss": int(rss),
                  "model_state_bytes": engine.memory_report()["model_states"],
                  "time": time.perf_counter() - t_start}
        if cfg.eval_interval and (done % cfg.eval_interval == 0 or last):
            record["val_loss"] = evaluate()

        if rank == 0:
            metrics.write(json.dumps(record) + "\n")
            if bar is not None:
                bar.update(1)
                if done % cfg.log_interval == 0 or last or "val_loss" in record:
                    bar.set_postfix_str(
                        f"loss {record['loss']:.4f}"
                        + (f" val {record['val_loss']:.4f}" if "val_loss" in record else "")
                        + f" {record['tokens_per_s']:,.0f} tok/s {mfu_label} {100 * record['mfu']:.1f}%"
                        + f" rss {_fmt_bytes(rss)} states {_fmt_bytes(record['model_state_bytes'])}")
            elif show == "lines" and (done % cfg.log_interval == 0 or last or "val_loss" in record):
                print(f"step {done}/{cfg.max_steps} loss {record['loss']:.4f}"
                      + (f" val_loss {record['val_loss']:.4f}" if "val_loss" in record else "")
                      + f" lr {lr:.2e} {record['tokens_per_s']:,.0f} tok/s"
                      + f" {mfu_label} {100 * record['mfu']:.2f}%"
                      + f" rss {_fmt_bytes(rss)} states {_fmt_bytes(record['model_state_bytes'])}", flush=True)

        if stop or last or (cfg.checkpoint_interval and done % cfg.checkpoint_interval == 0):
            save(done)
        if stop and not last:
            if bar is not None:
                bar.close()
            if rank == 0:
                metrics.close()
                name = signal.Signals(int(flags[0])).name
                print(f"zerompi.train: {name} received: "
                      + f"checkpoint of step {done} saved in {ckpt_dir}"
                      + f"; exiting with {EXIT_STOPPED} (requeue me)", flush=True)
            return EXIT_STOPPED

    if bar is not None:
        bar.close()
    if rank == 0:
        metrics.close()
        print(f"zerompi.train: done, {cfg.max_steps} steps in {time.perf_counter() - t_start:.1f}s", flush=True)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
