"""Runs many worker scripts in one MPI launch (tests/support/batch.py builds the plan).

argv: PLAN PROGRESS. Each case runs as `python WORKER.py --out OUT ARGS` would (runpy, a
fresh namespace); the modules it imports stay loaded, which is the point: MPI start-up,
torch and transformers are paid once per launch. A case that raises writes its traceback
to OUT.err.rRANK. When every rank has ended the case (raising or not) the ranks agree on
it, on a communicator of their own, and go on; a rank that raised while a peer still
waits in one of the case's collectives (no agreement within GRACE_S) aborts the launch,
and the runner starts the cases after it in a new one. Rank 0 writes `start I T` and
`end I T` to PROGRESS, so the runner knows which case runs and when it began.
"""
from zerompi.runtime import pause_collector; pause_collector()  # until freeze_startup_heap: runtime/pygc.py
import gc
import json
import os
import runpy
import sys
import time
import traceback

from mpi4py import MPI
from zerompi.comm import mpi as zmpi
import zerompi.runtime
zerompi.runtime.freeze_startup_heap()  # as zerompi.train does (runtime/pygc.py)

# a peer still computing its part of a case reaches the agreement sooner than this
GRACE_S = float(os.environ.get("BATCH_GRACE_S", "20"))

plan_path, progress_path = sys.argv[1:3]
with open(plan_path) as f:
    plan = json.load(f)
world = MPI.COMM_WORLD
ctl = world.Dup()  # never matched against a case's own collectives
here = os.path.dirname(os.path.abspath(__file__))
progress = open(progress_path, "a") if world.rank == 0 else None

# mpi4py does not free a communicator when its Python object goes, and a process has 2048
# context ids (~20 communicators per parity case): keep the ones a case's zerompi objects
# create and free them when the case has ended on every rank.
created = []
_init = zmpi.MPICommunicator.__init__


def _keeping_init(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    created.append(self.comm)


zmpi.MPICommunicator.__init__ = _keeping_init


def free_created() -> None:
    while created:
        c = created.pop()
        if c not in (MPI.COMM_WORLD, MPI.COMM_SELF, MPI.COMM_NULL):
            try:
                c.Free()
            except MPI.Exception:
                pass


def note(what: str, i: int) -> None:
    if progress is not None:
        progress.write(f"{what} {i} {time.time():.3f}\n")
        progress.flush()


def run(case: dict) -> str | None:
    """The case's traceback, or None."""
    script = os.path.join(here, case["worker"] + ".py")
    saved_argv, saved_env = sys.argv, {k: os.environ.get(k) for k in case["env"]}
    os.environ.update(case["env"])
    sys.argv = [script, "--out", case["out"]] + case["args"]
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code not in (None, 0):
            return f"SystemExit: {e.code}\n"
    except BaseException as e:  # noqa: B036 - recorded; the agreement below decides what follows
        tb = e.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename != script:  # from the worker's frames on
            tb = tb.tb_next
        return "".join(traceback.format_exception(type(e), e, tb or e.__traceback__))
    finally:
        sys.argv = saved_argv
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return None


for i, case in enumerate(plan):
    note("start", i)
    if world.rank == 0:
        print(f"[batch] case {i}: {case['name']}", flush=True)
    err = run(case)
    if err is not None:
        with open(f"{case['out']}.err.r{world.rank}", "w") as f:  # before any abort
            f.write(err)
        sys.stderr.write(f"[rank {world.rank}] [batch] case {i} raised:\n{err}")
        sys.stderr.flush()
    req = ctl.Ibarrier()
    limit = time.monotonic() + GRACE_S if err is not None else None
    while not req.Test():  # polling with sleeps: waiting ranks leave the cores to the others
        if limit is not None and time.monotonic() > limit:
            sys.stderr.write(f"[rank {world.rank}] [batch] peers still inside case {i}: aborting the launch\n")
            sys.stderr.flush()
            ctl.Abort(1)
        time.sleep(0.005)
    free_created()
    gc.collect()  # engines of this case: hooks, buffers
    # what survives (torch, transformers' model classes, caches) is long-lived: frozen,
    # the next collection does not walk it again (0.23 s a case on each rank before)
    gc.freeze()
    note("end", i)
