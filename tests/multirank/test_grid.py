"""The process grid (zerompi.parallel.ParallelDims), the Communicator protocol, and the
engine built on an explicit grid (it partitions over dims.dp, never the world)."""
import pytest
import torch

from batch import batched, worker


def grid(n, tp):
    return worker(n, "grid_protocol", "--tp", str(tp), timeout=240)


@batched(lambda n, tp: grid(n, tp))
@pytest.mark.parametrize("n,tp", [(1, 1), (3, 1), (4, 2)])
def test_grid_groups_and_protocol(result, n, tp):
    res = result
    assert [x["rank"] for x in res] == list(range(n))
    for x in res:
        r = x["rank"]
        assert x["protocol"]
        assert (x["tp_size"], x["dp_size"]) == (tp, n // tp)
        # tensor-parallel ranks are adjacent (share a node); dp groups stride by tp
        assert x["tp_members"] == [r // tp * tp + i for i in range(tp)]
        assert x["dp_members"] == list(range(r % tp, n, tp))
        assert (x["tp_rank"], x["dp_rank"]) == (r % tp, r // tp)
        assert x["all_to_all"] and x["all_to_all_counted"]
        assert x["engine_comm_is_dp"]
        assert x["tp_replicas_identical"]
        if n > 1:
            assert x["gather_after_timeout"]
            if r == 0:
                assert x["timeout_seen_on_rank0"] is True


@batched(lambda: (grid(4, 2), grid(2, 1)))
def test_engine_on_a_dp_subgroup_equals_the_plain_run(result):
    """tp = 2 at N = 4 gives two dp groups of 2; each must train exactly as a 2-rank job."""
    sub, plain = (r[0]["params"] for r in result)
    assert torch.equal(torch.tensor(sub), torch.tensor(plain))


def test_tp_size_must_divide_the_world(tmp_path):
    from mpirun import run_mpi

    code = ("from zerompi.parallel import ParallelDims\n"
            "try:\n    ParallelDims.create(tp_size=2)\nexcept ValueError as e:\n"
            "    print(e, flush=True)\n")
    r = run_mpi(3, ["-c", code], module=False)  # every rank raises, none waits on another
    assert r.stdout.count("config key 'tensor_parallel_size' = 2: must divide the number of ranks (3)") == 3
