"""Stuck-rank scenarios for tests/system/test_reliability.py, launched WITHOUT `-m mpi4py`:
zerompi's watchdog must end the job. argv: MODE STAGE [PIDFILE].
stop-self, stop-in-backward, wait, wait-long: with PIDFILE, each rank writes its pid
to PIDFILE.<rank>.

stop-self: rank N-1 sends itself SIGSTOP at step 3 (a dead node, a hung GPU): the
  others block in the next collective until the watchdog's deadline.
stop-in-backward: rank N-1 stops itself between forward and backward at step 3, with
  one small bucket slot (stage 3: the others wait for a bucket in the reducer's loop
  that serves gather rounds, zero/grads.py GradReducer._complete).
stop-in-save: rank N-1 stops itself where the others start a checkpoint save (step 3,
  PIDFILE = the checkpoint directory): they wait under the save's generous deadline.
wait-long: as wait, with stop_grace_s = 120: a second SIGINT must end it.
nan-fp16: as nan in fp16 with a loss scale that reaches its minimum in 2 overflows.
nan: rank 0 feeds NaN from step 2 on: the job stops after 3 skipped steps (Diverged).
uneven: rank 1 takes 6 steps, rank 0 5 and then idles.
wait: every rank writes its pid to PIDFILE.<rank>, trains, and rank N-1 stops itself at
  step 3; the test then signals mpiexec (SIGTERM to a blocked job).
"""
from zerompi.runtime import pause_collector; pause_collector()  # until freeze_startup_heap: runtime/pygc.py
import os
import signal
import sys
import time

import torch

import zerompi
from zerompi.runtime import watchdog
from mpi4py import MPI
zerompi.runtime.freeze_startup_heap()  # as zerompi.train does (runtime/pygc.py)

mode, stage = sys.argv[1], int(sys.argv[2])
rank, size = MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size
torch.manual_seed(0)
torch.set_num_threads(1)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 1))
cfg = {"stage": stage, "comm": {"timeout_s": 4.0, "startup_timeout_s": 60.0, "stop_grace_s": 2.0}}
if mode == "nan-fp16":  # the scale collapses fast: 4 -> 2 -> 1, then overflow at the minimum
    cfg.update(precision="fp16", fp16={"initial_scale": 4.0, "min_scale": 1.0, "hysteresis": 1})
if mode == "stop-in-backward":  # many blocks, one slot: the second launch waits for the first
    cfg.update(bucket_size=16, bucket_count=1, stage3={"persistence_threshold": 1 << 20})  # no gathers in backward
if mode in ("wait", "wait-long"):
    cfg["comm"]["timeout_s"] = 120.0  # the signal, not the deadline, must end it
    if mode == "wait-long":
        cfg["comm"]["stop_grace_s"] = 120.0  # only a second SIGINT can end it quickly
    watchdog.install_stop_signals()
if mode in ("wait", "wait-long") or (mode in ("stop-self", "stop-in-backward") and len(sys.argv) > 3):
    with open(f"{sys.argv[3]}.{rank}", "w") as f:  # the test checks that every rank is gone
        f.write(str(os.getpid()))
engine = zerompi.initialize(model, cfg)
x = torch.randn(4, 8)
steps = 100000 if mode != "uneven" else 5 + (rank == 1)
for step in range(steps):
    if rank == size - 1 and step == 3 and mode in ("stop-self", "wait", "wait-long", "stop-in-save"):
        print(f"rank {rank} stopping itself at step {step}", flush=True)
        if mode.startswith("wait"):
            open(f"{sys.argv[3]}.stopped", "w").close()
        os.kill(os.getpid(), signal.SIGSTOP)
    if mode == "stop-in-save" and step == 3:
        engine.save_checkpoint(sys.argv[3])
    if mode.startswith("nan") and rank == 0 and step >= 1:
        x = torch.full((4, 8), float("nan"))  # one rank's NaN reaches every rank's gradient
    loss = engine(x).pow(2).mean()
    if rank == size - 1 and step == 3 and mode == "stop-in-backward":
        print(f"rank {rank} stopping itself before backward at step {step}", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
    engine.backward(loss)
    engine.step()
    if watchdog.stop_signal():
        print(f"rank {rank}: stop signal seen between steps", flush=True)
        break
    time.sleep(0.01)
print(f"rank {rank}: loop ended", flush=True)
if mode == "uneven":
    time.sleep(60)  # rank 0 does something else; rank 1 waits in its extra step
