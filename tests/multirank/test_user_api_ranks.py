"""The engine's user API at 2-4 ranks (issue 42; one rank: tests/unit/test_user_api.py):
a torch.distributed group from the MPI world beside the engine, a DeepSpeedExamples-style
loop with the import changed that resumes bitwise mid-epoch, and collective methods called
on a subset of ranks ending the job, named."""
import pytest

from batch import batched, worker
from mpirun import WORKERS, run_mpi

W = str(WORKERS / "engine_api.py")


@batched(lambda n, stage: worker(n, "engine_api", "dist", str(stage), timeout=240))
@pytest.mark.parametrize("n,stage", [(2, 3), (4, 1)])
def test_process_group_beside_the_engine(n, stage, result):
    r = result
    assert r["backend"] == "gloo" and (r["rank"], r["size"]) == (0, n)
    shares = r["all_indices"]
    flat = sorted(i for s in shares for i in s)
    assert len({len(s) for s in shares}) == 1 and set(flat) == set(range(23))  # a share each, all covered
    assert len(flat) == 23 + (-23 % n)  # DistributedSampler pads to a multiple of the ranks
    # the metric all-reduce summed every rank's loss: the same on every rank
    assert r["all_losses"] == [r["losses"]] * n


@batched(lambda n, stage: worker(n, "engine_api", "ds_loop", str(stage), "{dir}", timeout=300))
@pytest.mark.parametrize("n,stage", [(2, 1), (2, 3), (3, 2)])
def test_deepspeed_examples_loop_runs_and_resumes_mid_epoch(n, stage, result):
    r = result
    per_epoch = -(-40 // n) // 2  # ceil(40 / n) samples per rank, micro-batch 2
    assert r["steps"] == 2 * per_epoch and r["resumed_steps"] == 2 * per_epoch - 12
    assert r["same_losses"] and r["same_params"] and r["moved"], r
    assert r["global_steps"] == per_epoch  # 2 micro-batches per update (train_batch_size 4 x N)
    assert r["last_loss"] < r["first_loss"]


def test_full_state_dict_on_one_rank_ends_the_job_naming_it():
    """Rank 0 alone calls full_state_dict at stage 3, rank 1 trains on: the job ends
    within the deadline (timeout_s = 3) naming the call and the other rank."""
    res = run_mpi(2, [W, "subset", "3"], timeout=90, module=False, check=False)
    out = res.stdout
    assert res.returncode == 3, out[-3000:]
    assert "engine.full_state_dict() (collective: every rank must call it)" in out, out[-3000:]
    assert ("not complete after 3 s" in out and "rank 1 waits in" in out) or "during engine.forward" in out \
        or "during engine.backward" in out, out[-3000:]
    assert res.elapsed < 45, res.elapsed


def test_different_collective_calls_raise_one_error_naming_them(tmp_path):
    res = run_mpi(2, [W, "mismatch", str(tmp_path / "ck")], timeout=90, module=False, check=False)
    out = res.stdout
    assert res.returncode != 0
    assert ("is collective: every rank must call it at the same point of the loop, but rank 0 called "
            "engine.full_state_dict() at micro-step 0; rank 1 called engine.save_checkpoint() at micro-step 0") \
        in out, out[-3000:]
