"""A map-style dataset as each data-parallel rank's share of micro-batches, resumable.

    loader = zerompi.integrations.data.ShardedLoader(dataset, batch_size=4, engine=engine)
    for epoch in range(2):
        for batch in loader:            # this rank's share of one epoch, then the next
            ...

`zerompi.initialize(..., training_data=dataset)` builds one (batch size: the config's
train_micro_batch_size_per_gpu) and attaches it to the engine, so its position goes into
every `engine.save_checkpoint` and comes back with `engine.load_checkpoint`: a resumed
run continues the epoch where the checkpoint was taken, at any data-parallel size.

Order: the epoch's permutation is DistributedSampler's (torch.randperm seeded with
seed + epoch; no shuffle: 0..n-1), padded by repeating its start to a multiple of the
ranks (drop_last=False) or cut (drop_last=True); rank r of dp takes every dp-th sample
from r, as DistributedSampler does. The position is the number of samples of the epoch
all ranks together have taken, so a resume at another data-parallel size gives the
remaining samples, in the same order, to the new ranks. Each pass (`iter(loader)`)
starts where the last one stopped; a finished pass moves to the next epoch (DeepSpeed's
loader repeats epoch 0's order unless its sampler's set_epoch is called).
"""
from __future__ import annotations

from typing import Any, Callable

import torch


class ShardedLoader:
    def __init__(self, dataset, batch_size: int, engine: Any = None, *, dp_rank: int | None = None,
                 dp_size: int | None = None, shuffle: bool = True, seed: int = 0, drop_last: bool = False,
                 collate_fn: Callable | None = None, num_workers: int = 0, pin_memory: bool = False):
        if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
            raise TypeError(f"training_data must be a map-style dataset (__len__ and __getitem__), got "
                            f"{type(dataset).__name__}")
        if int(batch_size) < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if engine is not None:
            dp_rank, dp_size = engine.dims.dp_rank, engine.dims.dp_size
        if dp_rank is None or dp_size is None:
            raise ValueError("ShardedLoader needs engine= or both dp_rank= and dp_size=")
        self.dataset, self.batch_size = dataset, int(batch_size)
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.collate_fn, self.num_workers, self.pin_memory = collate_fn, num_workers, pin_memory
        self.epoch = 0
        self.samples = 0  # samples of this epoch taken by all ranks together
        if engine is not None:
            from ..zero.calls import attach_state

            attach_state(engine, "training_data", self)

    def _remaining(self) -> list[int]:
        """The epoch's samples not yet taken, in order, padded (by repeating the epoch's
        start) or cut to a multiple of dp_size, so every rank gets as many batches."""
        n = len(self.dataset)
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            perm = torch.randperm(n, generator=g).tolist()
        else:
            perm = list(range(n))
        rest = perm[self.samples:]
        if self.drop_last:
            return rest[:len(rest) - len(rest) % self.dp_size]
        pad = -len(rest) % self.dp_size
        while pad > 0:
            rest += perm[:pad]
            pad = -len(rest) % self.dp_size
        return rest

    def __len__(self) -> int:
        """Micro-batches this rank gets in the rest of this epoch (all of it, from the start)."""
        return -(-(len(self._remaining()) // self.dp_size) // self.batch_size)

    def __iter__(self):
        rest = self._remaining()
        n = len(self.dataset)
        mine = rest[self.dp_rank::self.dp_size]
        loader = torch.utils.data.DataLoader(self.dataset, batch_size=self.batch_size, sampler=mine,
                                             collate_fn=self.collate_fn, num_workers=self.num_workers,
                                             pin_memory=self.pin_memory)
        for batch in loader:
            # every rank takes batch_size samples per batch (the last batch: what is left)
            self.samples = min(n, self.samples + self.batch_size * self.dp_size)
            yield batch
        self.epoch, self.samples = self.epoch + 1, 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "samples": self.samples, "seed": self.seed, "shuffle": self.shuffle,
                "dataset_len": len(self.dataset)}

    def load_state_dict(self, state: dict) -> None:
        if state.get("dataset_len", len(self.dataset)) != len(self.dataset):
            raise ValueError(f"training_data: the checkpoint's loader position is for a dataset of "
                             f"{state['dataset_len']} samples, this one has {len(self.dataset)}")
        self.epoch, self.samples = int(state["epoch"]), int(state["samples"])
        self.seed, self.shuffle = state.get("seed", self.seed), state.get("shuffle", self.shuffle)
