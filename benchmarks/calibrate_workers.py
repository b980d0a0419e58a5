"""calibrate_comm.py's per-rank workers (run under mpiexec by its driver): `fit` times
zerompi's own collectives on cache-cold buffers of many sizes; `check` runs real stage-2
engine steps and replays one step's collectives without compute."""
from __future__ import annotations

import json
import os
import statistics
import time
from collections import Counter
from pathlib import Path

from harness import RANK_ENV, machine_info, quiet_barrier, software_info

ARENA = 32 << 20  # elements (128 MiB fp32): 4x the L3 cache of the machine this was written on


def _mean_over_ranks(comm, x: float) -> float:
    return comm.allreduce(x) / comm.Get_size()


def worker_fit(args) -> dict:
    import torch
    from mpi4py import MPI

    from zerompi.comm.mpi import MPICommunicator

    world = MPI.COMM_WORLD
    n = world.Get_size()
    comms = {"ordered": MPICommunicator(world, "ordered"), "native": MPICommunicator(world, "native")}
    samples = []
    for k in range(args.min_log2, args.max_log2 + 1):
        B = 1 << k  # full buffer, elements
        c = B // n
        # Buffers behave in cache as in a stage-2 step: the reduce-scatter's send bucket is
        # freshly written (two slots alternate, as bucket_count = 2), its receive space
        # alternates with it; each all-gather fills a different block of a parameter buffer
        # far larger than the cache (here a pool of >= 128 MiB, 4x this machine's L3).
        m = max(2, ARENA // B)
        src = torch.rand(m * B)
        slots = [(torch.empty(B), torch.empty(B), torch.empty(c)) for _ in range(2)]
        full = torch.rand(m * B)
        it = [0]

        def rs(cm):
            i = it[0] = it[0] + 1
            send, scratch, recv = slots[i % 2]
            send.copy_(src[(i % m) * B:][:B])  # the bucket fill (not timed: comm_stats times waits)
            cm.reduce_scatter(send, recv, scratch=scratch)

        def ag():
            i = it[0] = it[0] + 1
            blk = full[(i % m) * B:][:B]
            comms["ordered"].all_gather(blk[world.Get_rank() * c:][:c], blk)

        ops = {"reduce_scatter/ordered": lambda: rs(comms["ordered"]),
               "reduce_scatter/native": lambda: rs(comms["native"]), "all_gather": ag}
        for name, fn in ops.items():
            comm = comms["native" if name.endswith("native") else "ordered"]
            opname = name.split("/")[0]
            world.Barrier()
            fn()  # warm-up, and a first time for the repetition count
            t0 = time.perf_counter()
            fn()
            t1 = world.allreduce(time.perf_counter() - t0, op=MPI.MAX)
            reps = max(1, min(4000, int(args.seconds_per_point / args.batches / max(t1, 1e-7))))
            per_call = []
            for _ in range(args.batches):
                world.Barrier()
                comm.reset_stats()
                for _ in range(reps):
                    fn()
                s = comm.stats()[opname]["seconds"] / reps
                per_call.append(_mean_over_ranks(world, s))
            samples.append({"op": name, "elements": B, "nbytes": 4 * B, "n": n, "reps": reps,
                            "batches": per_call, "seconds": statistics.median(per_call)})
            if world.Get_rank() == 0:
                print(f"[fit N={n}] {name:24s} 2^{k:2d} elements: {samples[-1]['seconds'] * 1e6:10.1f} us "
                      f"({reps} x {args.batches})", flush=True)
    return {"phase": "fit", "n": n, "samples": samples}


def worker_check(args) -> dict:
    import torch
    from mpi4py import MPI

    import zerompi
    from zerompi.models.gpt import GPT, PRESETS

    world = MPI.COMM_WORLD
    rank, n = world.Get_rank(), world.Get_size()
    gcfg = PRESETS[args.model]
    out = []
    for lb in args.buckets:
        torch.manual_seed(0)
        model = GPT(gcfg)
        engine = zerompi.initialize(model, {"stage": 2, "bucket_size": 1 << lb,
                                            "optimizer": {"lr": 1e-4, "weight_decay": 0.1}})
        comm, layout = engine.comm, engine.layout

        def batch(i):
            g = torch.Generator().manual_seed(1000 * rank + i)
            t = torch.randint(0, gcfg.vocab_size, (args.micro_batch, args.seq_len + 1), generator=g)
            return t[:, :-1].contiguous(), t[:, 1:].contiguous()

        eng_s, eng_ops, walls = [], [], []
        for i in range(args.warmup + args.steps):
            x, y = batch(i)
            quiet_barrier(world)
            engine.reset_comm_stats()
            t0 = time.perf_counter()
            _, loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            wall = time.perf_counter() - t0
            st = engine.comm_stats()
            if i >= args.warmup:
                eng_s.append(_mean_over_ranks(world, sum(v["seconds"] for v in st.values())))
                eng_ops.append({k: _mean_over_ranks(world, st[k]["seconds"]) for k in sorted(st)})
                walls.append(world.allreduce(wall, op=MPI.MAX))
        calls = {k: v["calls"] for k, v in engine.comm_stats().items()}

        # replay: exactly the step's collectives, blocking, without compute
        sizes = [e - s for s, e in layout.blocks]
        order = list(engine.reducer.order)
        big = max(sizes)
        # as the engine: two bucket slots (send, alltoall receive, own chunk), each filled
        # from the full gradient just before its reduce-scatter; all-gathers into the blocks
        # of one full parameter buffer
        slots = [(torch.empty(big), torch.empty(big), torch.empty(big // n)) for _ in range(2)]
        grad, flat = torch.rand(layout.total), torch.rand(layout.total)
        nscal = 1 + len(engine.params)
        rep_s, rep_ops, rep_wall = [], [], []
        for r in range(args.replays + 1):
            world.Barrier()
            comm.reset_stats()
            t0 = time.perf_counter()
            for i, k in enumerate(order):  # backward: one reduce-scatter per block, agreed order
                b, (send, scratch, recv) = sizes[k], slots[i % 2]
                send[:b].copy_(grad[layout.blocks[k][0]:layout.blocks[k][1]])  # untimed, as in the engine
                comm.reduce_scatter(send[:b], recv[:b // n], scratch=scratch)
            comm.allreduce_scalars([1.0] * nscal)  # step: norm + used flags
            for s, e in layout.blocks:  # refresh: one all-gather per block
                c = (e - s) // n
                comm.all_gather(flat[s + rank * c:s + (rank + 1) * c], flat[s:e])
            wall = time.perf_counter() - t0
            st = comm.stats()
            if r > 0:  # the first one is a warm-up
                rep_s.append(_mean_over_ranks(world, sum(v["seconds"] for v in st.values())))
                rep_ops.append({k: _mean_over_ranks(world, st[k]["seconds"]) for k in sorted(st)})
                rep_wall.append(world.allreduce(wall, op=MPI.MAX))
        res = {"bucket_log2": lb, "bucket_size": 1 << lb, "block": layout.block, "blocks": len(sizes),
               "block_sizes": dict(Counter(sizes)), "scalars": nscal, "params": sum(layout.numels),
               "padded": layout.total, "engine_calls_per_step": calls,
               "engine_seconds": eng_s, "engine_by_op": eng_ops, "engine_step_wall_s": walls,
               "replay_seconds": rep_s, "replay_by_op": rep_ops, "replay_wall_s": rep_wall,
               "engine_median_s": statistics.median(eng_s), "replay_median_s": statistics.median(rep_s)}
        out.append(res)
        if rank == 0:
            print(f"[check N={n}] bucket 2^{lb}: {len(sizes)} blocks, engine comm "
                  f"{res['engine_median_s'] * 1e3:.1f} ms/step, replay {res['replay_median_s'] * 1e3:.1f} ms",
                  flush=True)
        del engine, model, slots, grad, flat
    return {"phase": "check", "n": n, "model": args.model, "micro_batch": args.micro_batch,
            "seq_len": args.seq_len, "checks": out}


def worker(args) -> None:
    for k, v in RANK_ENV.items():
        os.environ.setdefault(k, v)
    import torch
    from mpi4py import MPI

    torch.set_num_threads(1)
    res = worker_fit(args) if args.worker == "fit" else worker_check(args)
    if MPI.COMM_WORLD.Get_rank() == 0:
        res.update(machine=machine_info(), software=software_info(), loadavg_end=os.getloadavg())
        Path(args.out).write_text(json.dumps(res, indent=1))
