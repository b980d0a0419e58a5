"""The engine's user API at N ranks (tests/multirank/test_user_api_ranks.py).

  dist STAGE         zerompi.init_process_group beside an engine: dist.get_rank/size are
                     MPI's, DistributedSampler gives each rank its share, a metric
                     all-reduce (gloo) between engine steps sums over the ranks
  ds_loop STAGE DIR  a DeepSpeedExamples-style loop (`import zerompi as deepspeed`,
                     add_config_arguments, init_distributed, initialize(args, model,
                     model_parameters, training_data)) over two epochs, saved mid-epoch;
                     a fresh engine + loader resumed from it ends bitwise where the run did
  subset STAGE       rank 0 alone calls engine.full_state_dict(): the watchdog ends the job
  mismatch           rank 0 calls full_state_dict, the others save_checkpoint: one error
"""
import argparse
import json
import os
import sys
import time

import torch
import torch.nn as nn
from mpi4py import MPI

import zerompi

torch.set_num_threads(1)
ap = argparse.ArgumentParser()
ap.add_argument("--out")
ap.add_argument("mode")
ap.add_argument("rest", nargs="*")
a = ap.parse_args()
world = MPI.COMM_WORLD
rank, size = world.rank, world.size


class Net(nn.Module):  # the cifar example's shape, smaller
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(12, 16), nn.Linear(16, 5)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def dataset(n=40):
    g = torch.Generator().manual_seed(7)
    return torch.utils.data.TensorDataset(torch.randn(n, 12, generator=g), torch.randint(0, 5, (n,), generator=g))


def dist_mode(stage):
    import torch.distributed as dist

    torch.manual_seed(0)
    engine = zerompi.initialize(Net(), {"stage": stage})
    backend = zerompi.init_process_group()
    data = dataset(23)
    sampler = torch.utils.data.DistributedSampler(data, shuffle=True, seed=3)
    loader = torch.utils.data.DataLoader(data, batch_size=4, sampler=sampler)
    seen, losses = [], []
    for x, y in loader:
        loss = nn.functional.cross_entropy(engine(x), y)
        engine.backward(loss)
        engine.step()
        metric = loss.detach().clone()
        dist.all_reduce(metric)  # the user's own metric all-reduce, between engine steps
        losses.append(metric.item())
        seen += [int(v) for v in (x[:, 0] * 1e6).round()]
    mine = list(sampler)
    return {"backend": backend, "rank": dist.get_rank(), "size": dist.get_world_size(), "indices": mine,
            "all_indices": world.allgather(mine), "losses": losses, "all_losses": world.allgather(losses),
            "n_seen": len(seen)}


def ds_loop(stage, d):
    """Two epochs of 10 micro-batches per rank (40 samples / N ranks / batch 4 x ... ),
    saved after micro-step 12 (an update boundary); then a fresh run resumed from that checkpoint."""
    import zerompi as deepspeed  # the one changed line of a DeepSpeed script

    cfg = os.path.join(d, "ds_config.json")
    if rank == 0:
        with open(cfg, "w") as f:
            json.dump({"train_batch_size": 4 * size, "train_micro_batch_size_per_gpu": 2,
                       "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
                       "zero_optimization": {"stage": stage}, "gradient_clipping": 1.0}, f)
    world.Barrier()
    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", cfg])
    deepspeed.init_distributed()

    def run(resume: bool):
        torch.manual_seed(0)
        net = Net()
        parameters = filter(lambda p: p.requires_grad, net.parameters())
        model_engine, optimizer, trainloader, _ = deepspeed.initialize(
            args=args, model=net, model_parameters=parameters, training_data=dataset())
        criterion = nn.CrossEntropyLoss()
        if resume:
            assert model_engine.load_checkpoint(os.path.join(d, "ckpt")) == {"epoch": 1}
        steps, losses = model_engine.micro_steps, []
        for epoch in range(trainloader.epoch, 2):
            for i, data in enumerate(trainloader):
                inputs, labels = data[0].to(model_engine.device), data[1].to(model_engine.device)
                outputs = model_engine(inputs)
                loss = criterion(outputs, labels)
                model_engine.backward(loss)
                model_engine.step()
                losses.append(loss.item())
                steps += 1
                if steps == 12 and not resume:
                    model_engine.save_checkpoint(os.path.join(d, "ckpt"), client_state={"epoch": epoch})
        return model_engine, losses

    a_engine, a_losses = run(False)
    a_params = a_engine.full_state_dict()
    b_engine, b_losses = run(True)
    b_params = b_engine.full_state_dict()
    return {"steps": len(a_losses), "resumed_steps": len(b_losses), "same_losses": a_losses[12:] == b_losses,
            "same_params": rank != 0 or all(torch.equal(a_params[k], b_params[k]) for k in a_params),
            "moved": rank != 0 or any(not torch.equal(v, p.float()) for (k, v), p in
                                      zip(a_params.items(), Net().parameters())),
            "first_loss": a_losses[0], "last_loss": a_losses[-1], "global_steps": b_engine.global_steps}


def subset(stage):
    torch.manual_seed(0)
    engine = zerompi.initialize(Net(), {"stage": stage, "comm": {"timeout_s": 3}})
    x, y = torch.randn(4, 12), torch.randint(0, 5, (4,))
    for _ in range(2):
        engine.backward(nn.functional.cross_entropy(engine(x), y))
        engine.step()
    if rank == 0:
        engine.full_state_dict()  # only here: a bug the watchdog must name
    for _ in range(2):  # the others go on training, as a user's loop would
        engine.backward(nn.functional.cross_entropy(engine(x), y))
        engine.step()
    time.sleep(60)


def mismatch(d):
    engine = zerompi.initialize(Net(), {"stage": 1})
    if rank == 0:
        engine.full_state_dict()
    else:
        engine.save_checkpoint(d)


if a.mode == "dist":
    out = dist_mode(int(a.rest[0]))
elif a.mode == "ds_loop":
    out = ds_loop(int(a.rest[0]), a.rest[1])
elif a.mode == "subset":
    out = subset(int(a.rest[0]))
else:
    out = mismatch(a.rest[0])
if rank == 0 and a.out:
    with open(a.out, "w") as f:
        json.dump(out, f)
sys.stdout.flush()
