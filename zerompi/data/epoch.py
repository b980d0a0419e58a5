"""Epoch order and document ids: pure functions of their arguments, shared by the
trainer's sampler (tokens.TokenSampler with order = "epoch") and the tests.

The training tokens are cut into W = (n - 1) // T windows of T + 1 tokens at stride T
(window w starts at token w * T: the same windows evaluation walks). Sample position p
(p = 0, 1, 2, ... over the whole run, global_batch of them per step) is window
perm_e[p mod W] of epoch e = p // W, where perm_e is a permutation seeded by (seed, e)
alone. So every window is visited exactly once per epoch, and the order depends on
neither the world size nor how the rows of a step are split over ranks and micro-steps;
a checkpoint records the position, and a resumed run continues from it exactly.
"""
from __future__ import annotations

import numpy as np

_STREAM = 0x45504F43  # "EPOC": keeps these permutations apart from other users of the seed


def epoch_permutation(seed: int, epoch: int, n_windows: int) -> np.ndarray:
    """The window order of `epoch` (int64, a permutation of range(n_windows))."""
    return np.random.default_rng([seed, _STREAM, epoch]).permutation(n_windows)


def epoch_windows(seed: int, n_windows: int, positions: np.ndarray, cache: dict | None = None) -> np.ndarray:
    """Window index of each sample position (see the module docstring). `cache` (optional,
    epoch -> permutation) keeps the last permutations between calls."""
    positions = np.asarray(positions, np.int64)
    epochs, idx = np.divmod(positions, n_windows)
    out = np.empty_like(positions)
    for e in np.unique(epochs):
        e = int(e)
        perm = cache.get(e) if cache is not None else None
        if perm is None:
            perm = epoch_permutation(seed, e, n_windows)
            if cache is not None:
                for old in [k for k in cache if k < e - 1]:
                    del cache[old]  # a step spans at most two epochs
                cache[e] = perm
        sel = epochs == e
        out[sel] = perm[idx[sel]]
    return out


def doc_ids(doc_starts: np.ndarray, offsets: np.ndarray, length: int) -> np.ndarray:
    """(rows, length) int64: the document of each token of the windows starting at
    `offsets`, as an index into `doc_starts` (sorted token offsets where documents start).
    Equal ids = same document; the attention mask is built from equality only."""
    pos = np.asarray(offsets, np.int64)[:, None] + np.arange(length, dtype=np.int64)
    return np.searchsorted(doc_starts, pos, side="right") - 1
