"""Stage 3 (and 1-2) on models nobody on the project wrote (tests/workers/zoo.py), against
single-process torch.optim.AdamW on the same global batch: parameters read outside their
module's forward, modules run on some ranks and not others, experts chosen differently
per rank, transformers BERT/T5/GPT-2/Llama/Mixtral. Tolerances: test_parity.py. The
parity cases run in their world size's batch (support/batch.py)."""
import pytest

from mpirun import WORKERS, run_mpi
from batch import batched
from parity_checks import ZOO_TIMEOUT, check_fp32, needs_transformers, parity

KINDS = [pytest.param(k, marks=needs_transformers) if k.startswith("hf-") else k
         for k in ["tenc", "flinear", "branch", "moe1", "moe2", "hf-bert", "hf-t5", "hf-gpt2", "hf-llama",
                   "hf-mixtral"]]


@batched(lambda kind: parity(2, "--model", kind, "--stages", "1,2,3", "--steps", "3", "--init", "0,1",
                             timeout=ZOO_TIMEOUT))
@pytest.mark.parametrize("kind", KINDS)
def test_stages_1_to_3_match_adamw_at_n2(kind, result):
    """Stage 3 built normally and under zerompi.Init; stages 1-2 unchanged."""
    check_fp32(result, stages=(1, 2, 3, "3_init"))


@batched(lambda kind: parity(3, "--model", kind, "--stages", "3", "--steps", "3", "--init", "0,1",
                             timeout=ZOO_TIMEOUT))
@pytest.mark.parametrize("kind", KINDS)
def test_stage3_with_and_without_init_matches_adamw_at_n3(kind, result):
    """An uneven N; partitioned construction (zerompi.Init) and a normal build."""
    check_fp32(result, stages=(3, "3_init"))


@batched(lambda kind: parity(3, "--model", kind, "--stages", "3", "--steps", "4",
                             "--unit-classes", "Sequential,Linear"))
@pytest.mark.parametrize("kind", ["branch", "moe1", "moe2"])
def test_units_run_on_some_ranks_only(kind, result):
    """Every Sequential and Linear its own unit, so whole units (experts, the branch, the
    skipped layer) run on some ranks and not others, differently per step: the gathers
    agree across ranks (no hang, no mixing of same-shaped experts) and parity holds.
    `foreign` > 0 proves ranks did diverge (a unit gathered only for a peer)."""
    check_fp32(result, stages=(3,))
    assert result["stage3"]["foreign"] > 0, result["stage3"]


@batched(lambda kind: parity(3, "--model", kind, "--stages", "3", "--steps", "4",
                             "--unit-classes", "Sequential,Linear", "--coalesce", "1000000"))
@pytest.mark.parametrize("kind", ["branch", "moe1"])
def test_coalesced_units_run_on_some_ranks_only(kind, result):
    """As above, with every run of sibling units merged (stage3.coalesce_elements): a
    merged unit some of whose roots run on some ranks only (an expert without tokens, a
    skipped layer) is still gathered in agreement, kept until its last root or the end
    of the phase, and parity holds."""
    assert any("+" in u for u in result["stage3"]["units"]), result["stage3"]["units"]
    check_fp32(result, stages=(3,))


def test_read_outside_the_unit_names_module_and_parameter():
    """A unit policy that separates F.linear's reader from the child it reads: a clear
    error naming both and the config key to change, and the job ends (no hang)."""
    r = run_mpi(2, [str(WORKERS / "parity.py"), "--out", "/dev/null", "--model", "flinear",
                    "--stages", "3", "--unit-classes", "Linear"], timeout=60, check=False)
    assert r.returncode != 0
    assert "module 'blocks.0' (_FBlock) read" in r.stdout, r.stdout[-3000:]
    assert "blocks.0.child.weight" in r.stdout and "zero.stage3.unit_classes" in r.stdout
    assert r.elapsed < 15


def test_read_appearing_after_the_first_step_ends_the_job_quickly():
    """The same read, first made on the second forward (flinear-late): the job still ends
    with the message, on the step that made it, within 10 s."""
    r = run_mpi(2, [str(WORKERS / "parity.py"), "--out", "/dev/null", "--model", "flinear-late",
                    "--stages", "3", "--steps", "3", "--gas", "1", "--unit-classes", "Linear"],
               timeout=60, check=False)
    assert r.returncode != 0
    assert "module 'blocks.0' (_FBlock) read" in r.stdout, r.stdout[-3000:]
    assert "[optimizer step 2, micro-step 2]" in r.stdout
    assert r.elapsed < 10
