"""The train command's agreements before the run (zerompi/train.py), on a world of two
whose other rank answers as the test says: a rank that resolves device "auto" otherwise
than rank 0 (a GPU some ranks do not see) ends the job with one line naming it; the
config check itself runs end to end in tests/system/test_train.py."""
import pytest
import torch

from zerompi import train
from zerompi.trainer import config as train_config


class TwoRanks:
    """Rank 0 of two; rank 1 passes `theirs` to every collective."""

    rank, size = 0, 2

    def __init__(self, theirs):
        self.theirs = theirs

    def allgather_object(self, obj):
        return [obj, obj if self.theirs is None else self.theirs.pop(0)]


@pytest.mark.skipif(torch.cuda.is_available(), reason="rank 0 must resolve auto to cpu")
def test_ranks_that_resolve_auto_differently_end_the_job_naming_the_rank(capsys):
    cfg = train_config.from_argv(["--device", "auto"])
    world = TwoRanks([[], {"device": "cuda"}])  # no failure on rank 1, then its device
    assert train._agreed_device(cfg, world) is None
    err = capsys.readouterr().err
    assert err == "zerompi.train: error: rank 1 has a different device than rank 0: device = 'cuda' " \
                  "(rank 0: 'cpu')\n", err


def test_the_same_device_everywhere_is_resolved():
    cfg = train_config.from_argv(["--device", "auto"])
    got = train._agreed_device(cfg, TwoRanks(None))
    assert got is not None and got.device == ("cuda" if torch.cuda.is_available() else "cpu")
