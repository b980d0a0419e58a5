"""Crash-safety worker: saves killed with SIGKILL at random moments.

--fork T (plain python, one rank): the parent imports torch once and forks T children in
turn. Each child resumes from DIR (load_checkpoint verifies it; a failure exits 3),
signals the parent, then trains and saves in a loop (keep_last=2, so rotation and the
removal of older checkpoints are hit too) until the parent SIGKILLs it after a random
delay. After every kill the parent verifies DIR/latest with sha256 and checks that it
names at least the last checkpoint the child reported as saved.

--mpi (under mpiexec): the same child loop on N ranks; prints "ready step S" once the
load is done and "saved TAG" after each save. --once: load, save once, exit.

--async: every save is asynchronous (--writer thread|process), one per step, so a
background write is nearly always in flight (each save waits for the one before); the
child also reports "begun TAG" when a save starts, and "saved TAG" once it is published
(by the next step's poll or by the save that waited for it). The parent then also checks
that every visible checkpoint verifies and that latest names a save that was begun and
is not older than the last one reported published: nothing unpublished is ever loaded.
--kill-rank R (with --mpi): rank R SIGKILLs itself after a random delay (--max-delay,
--seed) once ready, as a single node failure would; the launcher then ends the job.
"""
from zerompi.runtime import pause_collector; pause_collector()  # until freeze_startup_heap: runtime/pygc.py
import argparse
import json
import os
import random
import signal
import sys
import threading
import time

import torch  # noqa: F401  (imported before fork: children start warm)

import zerompi
from zerompi.checkpoint import CheckpointError, flush, poll, save, verify_checkpoint
from common import global_batch, make_model, micro_slices, vocab_of
zerompi.runtime.freeze_startup_heap()  # as zerompi.train does (runtime/pygc.py)

ap = argparse.ArgumentParser()
ap.add_argument("--dir", required=True)
ap.add_argument("--out")
ap.add_argument("--fork", type=int, default=0)
ap.add_argument("--mpi", action="store_true")
ap.add_argument("--once", action="store_true")
ap.add_argument("--max-delay", type=float, default=0.4)
ap.add_argument("--seed", type=int, default=0)
ap.add_argument("--async", dest="async_", action="store_true")
ap.add_argument("--writer", default="thread")
ap.add_argument("--kill-rank", type=int, default=-1)
a = ap.parse_args()


def child(report, once: bool) -> None:
    engine = zerompi.initialize(make_model("gpt"), {"stage": 2, "gradient_accumulation_steps": 1,
                                                    "bucket_size": 5000, "optimizer": {"lr": 1e-3}})
    rank, N = engine.comm.rank, engine.comm.size
    try:
        cs = engine.load_checkpoint(a.dir)
    except CheckpointError as e:
        print(f"LOAD FAILED: {e}", flush=True)
        os._exit(3)
    step = cs["data_step"] if cs else 0
    report(f"ready {step}")
    if a.kill_rank == rank:   # a node failure at a random moment from here on
        t = threading.Timer(random.Random(a.seed).uniform(0, a.max_delay), os.kill, (os.getpid(), signal.SIGKILL))
        t.daemon = True
        t.start()

    def published():
        saver = engine.checkpoint_view().saver
        for rec in saver.drain() if saver is not None else []:
            report(f"saved {rec['tag']}")

    while True:
        x, y = global_batch(step, 4, 16, vocab_of(engine.module))
        sl = micro_slices(4, 1, rank, N)[0]
        _, loss = engine(x[sl], y[sl])
        engine.backward(loss)
        engine.step()
        step += 1
        if a.async_:
            poll(engine)
            published()
            path = save(engine, a.dir, client_state={"data_step": step}, keep_last=2, async_save=True,
                        writer=a.writer)
            report(f"begun {os.path.basename(path)}")
            published()
            if once:
                flush(engine)
                published()
                return
            continue
        path = save(engine, a.dir, client_state={"data_step": step}, keep_last=2)
        report(f"saved {os.path.basename(path)}")
        if once:
            return


if a.mpi:
    child(lambda msg: print(msg, flush=True) if zerompi.runtime.mpi().COMM_WORLD.rank == 0 else None, a.once)
    sys.exit(0)



def spawn(once: bool):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child initialises MPI itself (singleton); the parent never does
        os.close(r)
        try:
            child(lambda msg: os.write(w, (msg + "\n").encode()), once)
        except BaseException:
            import traceback

            traceback.print_exc()
            os._exit(1)
        os._exit(0)
    os.close(w)
    return pid, r


rng = random.Random(a.seed)
log = []
pid, r = spawn(once=True)  # a first complete checkpoint: there is always a previous one
_, status = os.waitpid(pid, 0)
os.close(r)
if status != 0:
    sys.exit(f"initial save failed (status {status})")
m = verify_checkpoint(a.dir)
ever, expect = {m["tag"]}, m["client_state"]["data_step"]   # tags published so far; the next child's step
for trial in range(a.fork):
    pid, r = spawn(once=False)
    stream = os.fdopen(r)
    first = stream.readline().strip()
    if not first.startswith("ready"):
        os.waitpid(pid, 0)
        print(f"trial {trial}: child failed before it was ready: {first!r}")
        sys.exit(1)
    delay = rng.uniform(0, a.max_delay)
    time.sleep(delay)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    lines = stream.read().splitlines()
    saved = [ln.split()[1] for ln in lines if ln.startswith("saved")]
    begun = {ln.split()[1] for ln in lines if ln.startswith("begun")}
    stream.close()
    try:
        m = verify_checkpoint(a.dir)
        # every checkpoint that load or resume could pick verifies (none half-written)
        for e in os.listdir(a.dir):
            if not e.startswith(".") and os.path.isdir(os.path.join(a.dir, e)):
                verify_checkpoint(os.path.join(a.dir, e))
    except CheckpointError as e:
        print(f"trial {trial}: after a kill {delay:.3f}s in: {e}")
        sys.exit(1)
    # latest is the last reported save or the one after it (killed after publishing).
    if saved and m["counters"]["global_steps"] < int(saved[-1].split("-")[1]):
        print(f"trial {trial}: latest is {m['tag']}, older than the reported {saved[-1]}")
        sys.exit(1)
    if a.async_ and m["tag"] not in ever | begun:
        print(f"trial {trial}: latest is {m['tag']}, which was never saved")
        sys.exit(1)
    if int(first.split()[1]) != expect:   # the child loaded what latest named
        print(f"trial {trial}: resumed at {first}, latest was at step {expect}")
        sys.exit(1)
    ever |= set(saved) | {m["tag"]}
    expect = m["client_state"]["data_step"]
    log.append({"delay": delay, "resumed_at": int(first.split()[1]), "saves": len(saved), "latest": m["tag"],
                "published": saved, "begun": sorted(begun),
                "leftovers": sorted(e for e in os.listdir(a.dir) if e.startswith("."))})
with open(a.out, "w") as f:
    json.dump(log, f)
