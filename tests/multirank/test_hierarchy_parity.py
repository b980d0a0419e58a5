"""Hybrid sharding, two-level collectives and stage 3's secondary partition against
single-process torch AdamW (tests/workers/hierarchy.py runs every case of one launch).

1 x 4 ranks posing as 2 nodes of 2 (ZEROMPI_RANKS_PER_NODE=2), stages 1-3, fp32 and
bf16, resumed across modes; then the hybrid checkpoint resumed at tp 2 x dp 2; then a
mixture of experts whose ranks run different experts (stage-3 units gathered for a peer
only) in the modes whose collectives are chains.

Tolerances are tests/multirank/test_parity.py's: fp32 parameters within 16x the measured floor
(the reference summed in another order) of the reference, norms 1e-5 relative, losses
1e-5 absolute. bf16: losses within 0.03 of the fp32 reference (test_parity's bf16 bound)
and parameters within that same fp32 floor bound of the flat bf16 run, since only the
order of the fp32 sums differs between modes. Bitwise where the order is the same
(docs/architecture.md, "Hierarchy"): the secondary partition changes no value; two-level
and hybrid-by-node sum in the same order; shard groups of 1 sum as flat; results do not
depend on the bucket size; a run resumed in the same mode equals the uninterrupted one.
"""
from __future__ import annotations

from batch import batched, worker
from hierarchy_checks import cases as _cases, parity as _parity, same as _same
from parity_checks import ULP1

FORCE = {"ZEROMPI_RANKS_PER_NODE": "2"}
GAS = 2


# One launch of 4 ranks for all three (tests/support/batch.py): A saves the checkpoints that
# B resumes at tp 2 (in the session's batch directory, {tmp}); C is the mixture of experts.
A = worker(4, "hierarchy", "--save", "{tmp}/hier_ckpt", "--load", "{tmp}/hier_ckpt", env=FORCE, timeout=400)
B = worker(4, "hierarchy", "--tp", "2", "--load", "{tmp}/hier_ckpt",
           "--cases", "fp32/s3/node<fp32/s2/node,fp32/s1/two<fp32/s2/node", env=FORCE, needs=(A,), timeout=300)
C = worker(4, "hierarchy", "--model", "moe1", "--unit-classes", "Sequential,Linear",
           "--cases", "fp32/s3/two,fp32/s3/node,fp32/s3/sec2", env=FORCE, timeout=300)


@batched(lambda: (A, B))
def test_every_mode_matches_adamw(result):
    """Every case of A and B within the parity tolerance; the modes are what the
    keys ask for on 2 nodes of 2 (two-level: 4 ranks; node: 2 x 2; k1: 1 x 4;
    at tp 2 the dp group has one rank per node, so "node" is groups of 1)."""
    a, b = result
    for r in (a, b):
        for name, d in _cases(r).items():
            _parity(r, name, d)
    want = {"flat": ("flat", 4, 1), "two": ("two-level", 4, 1), "node": ("hybrid", 2, 2), "k1": ("hybrid", 1, 4),
            "sec": ("flat", 4, 1), "sec2": ("two-level", 4, 1)}
    for name, d in _cases(a).items():
        mode = name.split("<")[0].split("/")[2].removesuffix("+save")
        assert (d["mode"], d["group"], d["replicas"]) == want[mode], (name, d["describe"])
        assert (d["secondary_fills"] > 0) == mode.startswith("sec"), (name, d["secondary_fills"])
    assert [(d["mode"], d["group"], d["replicas"]) for d in _cases(b).values()] == \
        [("hybrid", 1, 2), ("two-level", 2, 1)]


@batched(lambda: C)
def test_divergent_units_gather_in_agreement(result):
    """Ranks run different experts: the agreement rounds decide every gather while the
    chains of two-level and hybrid collectives are in flight (no hang: every wait polls
    them), parity holds, units were gathered for a peer only, the secondary copy is used."""
    c = result
    for name, d in _cases(c).items():
        _parity(c, name, d)
        assert d["foreign"] > 0, (name, d["foreign"])
    assert _cases(c)["fp32/s3/sec2"]["secondary_fills"] > 0


@batched(lambda: A)
def test_bf16_modes_within_the_floor_of_flat(result):
    a = result
    tol = 16 * max(a["floor"], ULP1)
    checked = [(n, d["diff_flat"]) for n, d in _cases(a).items() if n.startswith("bf16") and "<" not in n
               and "/flat" not in n]
    assert len(checked) == 7 and all(diff is not None and diff <= tol for _, diff in checked), (checked, tol)


@batched(lambda: A)
def test_bitwise_where_the_order_is_the_same(result):
    a = result
    c = _cases(a)
    pairs = [  # the secondary partition only copies values
        ("fp32/s3/sec+save", "fp32/s3/flat"), ("fp32/s3/sec2", "fp32/s3/two"), ("bf16/s3/sec2", "bf16/s3/two"),
        # two levels: node sums added across nodes, as hybrid groups of a node are
        ("fp32/s1/two", "fp32/s1/node"), ("fp32/s2/two", "fp32/s2/node+save"), ("fp32/s3/two", "fp32/s3/node"),
        ("bf16/s1/two", "bf16/s1/node"), ("bf16/s2/two", "bf16/s2/node"), ("bf16/s3/two", "bf16/s3/node+save"),
        ("fp32/s3/k1", "fp32/s3/flat"),  # groups of one rank: the replicas add in rank order, as flat
        ("fp32/s2/two/b300", "fp32/s2/two"), ("fp32/s2/node/b300", "fp32/s2/node+save"),  # any bucket
        # resumed: the secondary copies are refilled after the load (never stale), the
        # hybrid checkpoint holds every piece once and loads into another mode and stage
        ("fp32/s3/sec<fp32/s3/sec", "fp32/s3/sec+save"), ("fp32/s3/sec2<fp32/s2/node", "fp32/s3/two")]
    for x, y in pairs:
        assert _same(c[x], c[y]), (x, y)
    assert not _same(c["fp32/s3/two"], c["fp32/s3/flat"])  # a different order: not bitwise (floor only)
    assert c["fp32/s3/flat"]["losses"][0] == c["fp32/s3/two"]["losses"][0]  # the first forward: no sum yet


@batched(lambda: A)
def test_memory_and_traffic_are_the_estimators(result):
    """Per-rank model states, the secondary copies and the collectives of one step
    (comm_stats(): calls counted as the logical ops, the hybrid all-reduce of each shard
    across groups included) equal what the estimator computes for the same mode."""
    from zerompi.config import ZeroConfig
    from zerompi.estimate import hierarchy as hier
    from zerompi.estimate.dryrun import DryRun, collectives
    from zerompi.estimate.memory import model_states
    from zerompi.estimate.models import from_shape
    from zerompi.comm.cost_model import PRESETS

    spec = from_shape("hierarchy-test", _gpt_cfg())
    modes = {"flat": "flat", "two": "two-level", "node": "hybrid node", "k1": None, "sec": "secondary",
             "sec2": "secondary + two-level"}
    a, runners = result, {}
    for name, d in _cases(a).items():
        prec, stage, mode, *rest = name.split("<")[0].removesuffix("+save").split("/")
        stage, bucket = int(stage[1:]), int(rest[0][1:]) if rest else 2000
        zc = ZeroConfig(precision=prec, bucket_size=bucket, gradient_accumulation_steps=GAS)
        if (prec, bucket) not in runners:  # one meta model per config
            runners[(prec, bucket)] = DryRun(spec, zc)
        runner = runners[(prec, bucket)]
        built = runner.build(4, stage, bucket, prec, k=d["group"])
        counted: dict = {}
        for row in collectives(built, stage, zc, prec, GAS):
            counted[row["op"]] = counted.get(row["op"], 0) + row["counted_elements"]
        assert counted == d["comm"], (name, counted, d["comm"])
        m = d["memory"]
        assert m["model_states"] == model_states(built.layout.total, d["group"], stage, prec)["model_states"], name
        if modes[mode]:
            priced = hier.price(runner, 4, 2, stage, hier.MODES[modes[mode]], prec, GAS, "param", bucket,
                                PRESETS["ndr-ib"], PRESETS["nvlink"])
            assert priced["model_states"] == m["model_states"], name
            assert priced["secondary_bytes"] == m.get("secondary", 0), (name, priced["secondary_bytes"], m)
            assert priced["buffers"] == m["buffers"], name


def _gpt_cfg():
    from zerompi.models.gpt import GPTConfig

    return GPTConfig(vocab_size=300, block_size=32, n_layer=2, n_head=4, n_embd=32)  # the worker's
