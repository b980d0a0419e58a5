"""ParallelDims: the process grid, built once per job and handed to everything that
communicates (engine, Init, GatheredParameters, checkpoints, the data loader).

    dims = ParallelDims.from_config(cfg)       # collective over COMM_WORLD
    engine = zerompi.initialize(model, cfg, dims=dims)

Ranks form a dp x tp grid. Tensor-parallel ranks are adjacent (world ranks
r // tp_size share a tp group), so with the usual block placement of ranks on nodes
they share a node and its fast links; data parallelism runs across tp groups, one dp
group per tp position. ZeRO partitions over `dp`. Each group is its own Communicator
(a private MPI communicator, so our traffic never meets the user's), and `world` is a
private duplicate of the whole job for the loop's own small reductions. The grid also
knows the nodes (nodes.py: MPI's shared-memory split, ZEROMPI_RANKS_PER_NODE to pose
as several nodes on one host) and holds a node-local and a cross-node group for
hierarchical collectives.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .. import runtime
from ..comm.base import Communicator
from ..config.errors import ConfigError
from .nodes import NodeLayout, discover


@dataclass(frozen=True)
class ParallelDims:
    world: Communicator   # every rank of the job
    dp: Communicator      # the data-parallel group of this rank (ZeRO shards here)
    tp: Communicator      # the tensor-parallel group of this rank (size 1 without tensor parallelism)
    # Where the ranks run (nodes.py). node: the ranks of this rank's node; cross_node: one
    # rank per node, the ones with this rank's node-local rank (for hierarchical collectives).
    nodes: NodeLayout | None = None
    node: Communicator | None = None
    cross_node: Communicator | None = None

    @property
    def dp_rank(self) -> int:
        return self.dp.rank

    @property
    def dp_size(self) -> int:
        return self.dp.size

    @property
    def tp_rank(self) -> int:
        return self.tp.rank

    @property
    def tp_size(self) -> int:
        return self.tp.size

    @property
    def rank(self) -> int:
        return self.world.rank

    @property
    def local_rank(self) -> int:
        return self.nodes.local_rank

    @classmethod
    def create(cls, tp_size: int = 1, world: Any = None, backend: str = "auto",
               reduce_scatter: str = "ordered", device: Any = None,
               nodes: NodeLayout | None = None) -> "ParallelDims":
        """Collective over `world` (an mpi4py communicator; default COMM_WORLD).
        `device`: where the tensors the groups move live (None/cpu: host; cuda[:k]: GPU),
        which backend 'auto' follows (comm.create). `nodes`: nodes.discover(world), when
        the caller has it already (train.py needs the node-local rank to pick a GPU);
        an uneven layout raises nodes.UnevenNodes on every rank."""
        from .. import comm as comm_mod

        base = runtime.init() if world is None else world
        n, r = base.Get_size(), base.Get_rank()
        if tp_size < 1 or n % tp_size:
            raise ConfigError("tensor_parallel_size", tp_size, f"must divide the number of ranks ({n})")
        make = lambda c: comm_mod.create(c, backend=backend, reduce_scatter=reduce_scatter,  # noqa: E731
                                         device=device)
        nodes = nodes or discover(base)
        if world is None and nodes.count > 1:  # the watchdog names COMM_WORLD ranks: add their nodes
            from ..runtime import watchdog

            watchdog.name_ranks_with(nodes.name_ranks)
        world_c = make(base)
        tp = world_c.split(color=r // tp_size, key=r)
        dp = world_c.split(color=r % tp_size, key=r)
        node = world_c.split(color=nodes.index, key=r)
        cross = world_c.split(color=nodes.local_rank, key=r)
        return cls(world=world_c, dp=dp, tp=tp, nodes=nodes, node=node, cross_node=cross)

    @classmethod
    def from_config(cls, cfg, world: Any = None, device: Any = None,
                    nodes: NodeLayout | None = None) -> "ParallelDims":
        """The grid a config asks for (tensor_parallel_size, comm.backend) for tensors on
        `device` (None: host); `cfg` is a ZeroConfig, or a dict or path zerompi.load_config reads."""
        if not hasattr(cfg, "tensor_parallel_size"):
            from ..config import load

            cfg = load(cfg)
        return cls.create(cfg.tensor_parallel_size, world=world, backend=cfg.comm.backend,
                          reduce_scatter=cfg.comm.reduce_scatter, device=device, nodes=nodes)

    def describe(self) -> str:
        where = f"; {self.nodes.describe()}" if self.nodes else ""
        return (f"dp {self.dp_size} x tp {self.tp_size} (rank {self.rank}: dp {self.dp_rank}, "
                f"tp {self.tp_rank}){where}")
