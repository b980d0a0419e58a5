"""The checkpoint format's pure helpers (zerompi/checkpoint/naming.py, hdf5.py, manifest_json.py): hyperslabs of a
flat piece, client_state as JSON, names and tags. Checkpoints written by jobs:
tests/multirank/test_checkpoint.py."""
import json
import random

import numpy as np
import pytest

from zerompi.checkpoint import hdf5, manifest_json, naming


def test_flat_blocks_tile_every_range():
    """A piece [lo, hi) of a parameter maps onto hyperslabs that cover exactly its
    elements, in row-major order (this is what index.h5's VDS mappings rely on)."""
    rng = random.Random(0)
    for _ in range(300):
        shape = tuple(rng.randint(1, 5) for _ in range(rng.randint(1, 4)))
        n = int(np.prod(shape))
        lo = rng.randint(0, n - 1)
        hi = rng.randint(lo + 1, n)
        seen = []
        for start, count in hdf5.flat_blocks(shape, lo, hi):
            idx = np.zeros(shape, dtype=bool)
            idx[tuple(slice(s, s + c) for s, c in zip(start, count))] = True
            seen.extend(np.flatnonzero(idx.ravel()))
        assert seen == list(range(lo, hi)), (shape, lo, hi)
        assert len(hdf5.flat_blocks(shape, lo, hi)) <= 2 * len(shape) - 1


def test_client_state_must_be_json():
    with pytest.raises(TypeError, match=r"client_state\['loader'\]\['rng'\]: Generator"):
        manifest_json.client_state_json({"step": 1, "loader": {"rng": np.random.default_rng()}})
    with pytest.raises(TypeError, match="key 3 is a int"):
        manifest_json.client_state_json({3: "x"})
    assert json.loads(manifest_json.client_state_json({"a": [1, 2.5, "x", None]})) == {"a": [1, 2.5, "x", None]}


def test_names_and_tags():
    assert naming.link_name("body.0.weight") == "body.0.weight"
    assert naming.link_name("a/b%c") == "a%2Fb%25c"
    for bad in ("", "latest", ".tmp-x", "a/b", "-x", "x" * 300):
        with pytest.raises(ValueError):
            naming.check_tag(bad)
