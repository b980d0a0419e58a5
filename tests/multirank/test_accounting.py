"""memory_report() and comm_stats() against the ZeRO paper's numbers (DESIGN.md section 1).

Memory: with T the padded parameter count (T - Psi < N * alignment), model-state bytes
per rank must equal the formula evaluated at T exactly; communication buffers are a
constant (bucket_count buckets, independent of the model). Traffic per step (GAS = 1):
stage 0 all-reduces 2T; stages 1-2 reduce-scatter T and all-gather T and all-reduce
nothing but the step's scalars (norm and per-parameter 'used' flags); one rank, nothing."""
import pytest

from batch import batched, worker


def expected(stage: int, precision: str, gdt: str, T: int, N: int) -> int:
    p = 4 if precision == "fp32" else 2       # working parameters
    g = 4 if (gdt == "fp32" or precision == "fp32") else 2
    k = 8 if precision == "fp32" else 12      # fp32: moments; mixed: + fp32 master
    if stage == 0:
        return p * T + g * T + k * T
    if stage == 1:
        return p * T + g * T + k * T // N
    if stage == 2:
        return p * T + g * T // N + k * T // N
    return (p + g + k) * T // N  # stage 3: (4 + K) Psi / N


@batched(lambda n: worker(n, "accounting", "--bucket", "4096"))
@pytest.mark.parametrize("n", [1, 2, 4])
def test_memory_and_traffic(n, result):
    r = result
    B = 4096
    for c in r["cases"]:
        stage, prec, gdt, gas = c["stage"], c["precision"], c["grad_accum_dtype"], c["gas"]
        m, comm = c["mem"], c["comm"]
        T, psi = m["padded_numel"], m["numel"]
        tag = (stage, prec, gdt, gas, n)
        assert 0 <= T - psi < n * 16 * (1 if stage < 3 else 20), tag  # stage 3: per unit
        assert m["model_states"] == expected(stage, prec, gdt, T, n), (tag, m)
        assert m["master"] == (0 if prec == "fp32" else 4 * T // (1 if stage == 0 else n)), (tag, m)
        if stage == 3:
            # nothing gathered between steps (one rank: the units are views of the shard)
            assert c["materialized"] == [], tag
            assert m["gathered"] == 0 and m["persistent"] == 0, (tag, m)
        assert c["updated"], tag
        if stage >= 2:
            assert c["loose_grad_bytes"] == 0, tag  # no full gradient survives a step outside the state
        if n == 1:  # alone: no bucket, no collective; gradients accumulate in the state
            assert m["buffers"] == 0 and comm == {}, (tag, m, comm)
            continue
        # one set of constant-size buckets: send + chunk + alltoall receive space
        assert 0 < m["buffers"] <= 2 * (B + B // n + B) * 4, (tag, m)
        scalars = 2 * (1 + c["num_params"])
        if stage == 0:
            # Counters record the volume handed to each collective (the paper's units),
            # the same at N = 1 where nothing crosses a link: 2T for the gradient.
            assert comm["all_reduce"]["elements"] == 2 * T + scalars, (tag, comm)
            assert "reduce_scatter" not in comm and "all_gather" not in comm, tag
        elif stage == 3:
            # forward + backward all-gathers of every unit and one reduce-scatter per
            # micro-step: 3 Psi per step at GAS 1
            assert comm["reduce_scatter"]["elements"] == gas * T, (tag, comm)
            assert comm["all_gather"]["elements"] == gas * (2 * T + c["tied_extra"]), (tag, comm)
            assert comm["all_reduce"]["elements"] == scalars, (tag, comm)
        else:
            assert comm["reduce_scatter"]["elements"] == (gas if stage == 2 else 1) * T, (tag, comm)
            assert comm["all_gather"]["elements"] == T, (tag, comm)
            assert comm["all_reduce"]["elements"] == scalars, (tag, comm)  # no gradient all-reduce
