"""One rank of bench_hierarchy.py: a GPT trained in one hierarchy mode on simulated nodes.

    (inside the cluster's mpiexec) python hierarchy_worker.py --dir D --tag T --stage 3 \
        --mode '{"shard_group": "node"}' [--precision fp32] [--warmup 2] [--steps 3]

Warm-up steps first; then a handshake with the driver through files in D (the nodes
share the host's filesystem): rank 0 writes T.mark0 and every rank waits for T.ack0,
written once the driver has read the veth counters; the measured steps; the same with
T.mark1 / T.ack1. So the counters span exactly the measured steps (and two sleeping
barriers). Each measured step is timed between two sleeping barriers, the slowest rank's
time kept. Rank 0 writes T.json.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch
from mpi4py import MPI

from bench_env import quiet_barrier
import zerompi
from zerompi.models.gpt import GPT, GPTConfig

# ~4.84M parameters: six layers of 0.79M (each unit 3.2 MB in fp32: ring all-gathers),
# the model's own unit (embeddings, final norm) 0.4 MB. A micro-batch of one 64-token
# sequence keeps compute small next to the shaped link.
CFG = GPTConfig(vocab_size=256, block_size=128, n_layer=6, n_head=8, n_embd=256)
BATCH, SEQ = 1, 64

ap = argparse.ArgumentParser()
ap.add_argument("--dir", required=True)
ap.add_argument("--tag", required=True)
ap.add_argument("--stage", type=int, default=3)
ap.add_argument("--precision", default="fp32")
ap.add_argument("--mode", default="{}", help="zero.* settings as JSON")
ap.add_argument("--warmup", type=int, default=2)
ap.add_argument("--steps", type=int, default=3)
a = ap.parse_args()
torch.set_num_threads(1)
world = MPI.COMM_WORLD


def handshake(i: int) -> None:
    quiet_barrier(world)
    if world.rank == 0:
        open(os.path.join(a.dir, f"{a.tag}.mark{i}"), "w").close()
    ack = os.path.join(a.dir, f"{a.tag}.ack{i}")
    while not os.path.exists(ack):
        time.sleep(0.005)
    quiet_barrier(world)


def step(engine, k: int) -> None:
    g = torch.Generator().manual_seed(1000 * k + world.rank)
    x = torch.randint(0, CFG.vocab_size, (BATCH, SEQ), generator=g)
    _, loss = engine(x, torch.roll(x, -1, 1))
    engine.backward(loss)
    engine.step()


torch.manual_seed(0)
cfg = {"stage": a.stage, "precision": a.precision, "optimizer": {"lr": 1e-4}, **json.loads(a.mode)}
engine = zerompi.initialize(GPT(CFG), cfg)
for k in range(a.warmup):
    step(engine, k)
handshake(0)
engine.reset_comm_stats()
times = []
for k in range(a.steps):
    quiet_barrier(world)
    t0 = time.perf_counter()
    step(engine, a.warmup + k)
    dt = time.perf_counter() - t0
    quiet_barrier(world)
    times.append(world.allreduce(dt, op=MPI.MAX))
stats = engine.comm_stats()
handshake(1)
if world.rank == 0:
    with open(os.path.join(a.dir, f"{a.tag}.json"), "w") as f:
        json.dump({"step_seconds": times, "comm_stats": stats, "memory": engine.memory_report(),
                   "describe": engine.groups.describe(), "mode": engine.groups.mode,
                   "params": sum(p.numel() for p in engine.params)}, f)
