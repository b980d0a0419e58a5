"""The own-loop sections of README.md and docs/quickstart.md are tested code (issue 42):
every Python block in them runs, in order, under mpiexec at 2 ranks, as written."""
import pytest

from batch import batched, worker
from doc_sections import python_blocks
from mpirun import ROOT

SECTIONS = [("README.md", "Using it from your own training loop", 4),
            ("docs/quickstart.md", "6. Your own training loop", 1)]


@batched(lambda file, heading, count: worker(2, "doc_blocks", str(ROOT / file), heading, "{dir}", timeout=300))
@pytest.mark.parametrize("file,heading,count", SECTIONS)
def test_every_python_block_of_the_own_loop_sections_runs(file, heading, count, result):
    assert len(python_blocks(str(ROOT / file), heading)) == count  # a block added is a block tested
    assert result == {"ran": list(range(1, count + 1)), "count": count}
