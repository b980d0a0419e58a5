"""Failure scenarios, launched WITHOUT `-m mpi4py`: zerompi's own abort hook must end
the job. Mode is argv[1]."""
import sys
import time

import torch

import zerompi
from mpi4py import MPI

mode = sys.argv[1]
rank = MPI.COMM_WORLD.rank
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
cfg = {"stage": 2}
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
    x = torch.randn(4, 8)
    loss = engine(x).pow(2).mean()
    engine.backward(loss)
    engine.step()
    time.sleep(0.01)
