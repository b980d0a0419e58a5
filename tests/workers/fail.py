"""Failure scenarios, launched WITHOUT `-m mpi4py`: zerompi's own abort hook must end
the job. Mode is argv[1]."""
from zerompi.runtime import pause_collector; pause_collector()  # until freeze_startup_heap: runtime/pygc.py
import sys
import time

import torch

import zerompi
from mpi4py import MPI
zerompi.runtime.freeze_startup_heap()  # as zerompi.train does (runtime/pygc.py)

mode = sys.argv[1]
rank = MPI.COMM_WORLD.rank
MPI.COMM_WORLD.Barrier()  # the test times the job from here, not from a start-up that load stretches
if rank == 0:
    print(f"all ranks up at {time.time():.3f}", flush=True)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
cfg = {"stage": 3 if mode.endswith("-s3") else 2}


class Boom(torch.autograd.Function):
    """Identity whose backward raises on rank 1 (an error deep inside autograd)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        raise RuntimeError("rank one failed inside backward")


if mode.startswith("raise-in-"):
    lin = torch.nn.Linear(8, 8)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            h = self.a(x)
            if rank == 1 and self.calls == 4:
                if mode.startswith("raise-in-forward"):
                    raise RuntimeError("rank one failed inside forward")
                h = Boom.apply(h)
            return self.b(h)

    model = Net()
if mode == "bad-config":
    cfg = {"stage": 2, "optimizer": {"lr": -1.0}}
elif mode == "bad-config-one-rank" and rank == 1:
    cfg = {"stage": 2, "gradient_clipping": "lots"}
elif mode == "different-config" and rank == 1:
    cfg = {"stage": 1}
elif mode == "different-model" and rank == 2:
    model = torch.nn.Sequential(torch.nn.Linear(8, 9), torch.nn.Linear(9, 1))
engine = zerompi.initialize(model, cfg)
for step in range(1000):
    if mode == "raise" and rank == 1 and step == 3:
        raise RuntimeError("rank one exploded on purpose")
    if mode == "released-read-s3" and rank == 1 and step == 2:
        # between steps stage 3 holds only shards: torch reads the empty storage and
        # crashes; faulthandler names this line
        print(float(model[0].weight.sum()), flush=True)
    x = torch.randn(4, 8)
    loss = engine(x).pow(2).mean()
    engine.backward(loss)
    engine.step()
    time.sleep(0.01)
