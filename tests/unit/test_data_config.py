"""The trainer's data keys (zerompi/trainer/config.py): `data` stays one string; the others
are flat keys, and a `data.x` / [data] table is named as typed with the flat key to use."""
import pytest

from zerompi.config.errors import ConfigError
from zerompi.trainer.config import load


def test_data_keys():
    cfg = load({"data": "shards/", "data_val": "val/", "data_dtype": "uint32", "data_order": "epoch",
                "doc_mask": True})
    assert (cfg.data, cfg.data_val, cfg.data_dtype, cfg.data_order, cfg.doc_mask) == \
        ("shards/", "val/", "uint32", "epoch", True)
    assert load({}, ["data=x.bin"]).data_order == "random"  # today's behaviour is the default


@pytest.mark.parametrize("source, overrides, key, needle", [
    ({}, ["data.dtype=uint32"], "data.dtype", "are flat: data_dtype"),
    ({"data": {"path": "x.bin"}}, [], "data.path", "data is one string"),
    ({}, ["data_dtype=uint64"], "data_dtype", "must be uint8, uint16, uint32 or int32"),
    ({}, ["data_order=shuffle"], "data_order", "must be random or epoch"),
])
def test_bad_data_keys_are_named_as_typed(source, overrides, key, needle):
    with pytest.raises(ConfigError, match=needle) as e:
        load(source, overrides)
    assert e.value.key == key
