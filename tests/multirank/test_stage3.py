"""Stage 3 beyond parity (test_parity.py): partitioned construction, temporary full
access, training under a memory cap, and the gather pool on a reference GPT: the same
pool memory step after step, no fresh allocation in steady state, results bitwise those
without the pool, a counted fallback when a user gathers more units at once than the
pool holds (its slot rules: tests/unit/test_gather_pool.py)."""
from batch import batched, worker
from mpirun import WORKERS, run_mpi


@batched(lambda: worker(3, "stage3_init", "--mode", "init"))
def test_init_builds_partitioned_and_identical(result):
    """Under zerompi.Init no parameter has full storage (each rank keeps ~1/N pieces),
    the values equal a normal build with the same seed bitwise (GPT's custom init goes
    through torch.nn.init), GatheredParameters reads full values before the engine exists
    and writes rank 0's edit back to every shard afterwards, and a step trains."""
    r = result
    for kind in ("gpt", "shapes", "raw"):  # raw: values set by the constructor alone
        d = r[kind]
        assert d["full_bytes"] == 0, d
        assert d["piece"] <= d["psi"] / 3 + 3 * 20, d  # 1/N plus per-parameter rounding
        assert d["early_ok"] and d["same_as_normal_build"] and d["edited"], d
        assert d["materialized"] == [], d


def _capped(tmp_path, *args):
    # A fixed mmap threshold makes freed blocks return to the OS at once (glibc's dynamic
    # threshold would keep them in the heap and count them against the cap).
    env = {"MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}
    return run_mpi(4, [str(WORKERS / "memcap.py"), "--out", str(tmp_path / "mc.json"),
                       "--budget-mb", "140", *args], timeout=120, env=env, check=False)


def test_partitioned_model_trains_under_a_cap_that_stops_stage0(tmp_path):
    """A 24 x Linear(1024) model (25.2M parameters, 100 MB in fp32) on 4 ranks, each
    capped (RLIMIT_AS) at 140 MB above its start-up address space. Built under
    zerompi.Init, stage 3 needs its states (16 bytes x Psi / 4 = 100 MB) plus a few units
    and buckets, and trains. Built normally, the full model (100 MB) plus the shards
    does not fit, and stage 0 (16 Psi = 400 MB) fails with the allocator's
    out-of-memory error on every rank, promptly. (With Adam at N = 4 the sharded states
    alone equal one fp32 copy, so a cap below the fp32 copy itself needs N > 4.)"""
    ok = _capped(tmp_path, "--stage", "3", "--init")
    assert ok.returncode == 0, ok.stdout[-3000:]
    for args in (["--stage", "3"], ["--stage", "0"]):
        bad = _capped(tmp_path, *args)
        assert bad.returncode != 0, args
        assert "can't allocate memory" in bad.stdout, bad.stdout[-3000:]
        assert bad.elapsed < 60


@batched(lambda: worker(3, "stage3_init", "--mode", "replicated"))
def test_gathered_parameters_edit_reaches_master_in_stages_0_to_2(result):
    """A bf16 engine keeps a separate fp32 master: rank 0's edit inside
    GatheredParameters(modifier_rank=0) reaches every rank and the master, and the next
    update moves on from it (lr 1e-3: within 0.01 of the edit) instead of undoing it."""
    r = result
    for stage in ("stage0", "stage1", "stage2"):
        assert r[stage] == {"working": True, "edited": True, "others_unchanged": True,
                            "kept_after_step": True}, (stage, r[stage])


@batched(lambda: worker(2, "stage3_pool"))
def test_reference_gpt_reuses_the_pool(result):
    r = result
    p, q = r["pool"], r["no_pool"]
    assert p["units"] == ["h.3", "h.2", "h.1", "h.0", "<root>"], p["units"]
    *blocks, root = p["unit_sizes"]  # blocks: 12,704 parameters each (padded to the layout)
    blk = max(blocks)
    assert p["slots"] == sorted([blk, blk, root]), (p["slots"], p["unit_sizes"])
    assert p["report"]["gather_pool"] == 4 * sum(p["slots"])
    assert q["report"]["gather_pool"] == 0
    # the same slot memory in every step, nothing allocated in steady state
    assert p["slots_same_memory"] and p["pointers_in_pool"], p
    assert len(set(map(tuple, p["pointers_per_step"]))) == 1, p["pointers_per_step"]
    assert p["fallbacks_training"] == 0 and p["report"]["gather_fallbacks"] == 0
    # bitwise the run that allocates and frees every gather
    assert p["losses"] == q["losses"] and p["params"] == q["params"]
    assert p["materialized"] == [] and p["report"]["gathered"] == 0
    # every unit at once: 5 units, 3 slots -> 2 fresh buffers, all returned afterwards
    assert p["gather_all_ok"] and p["fallbacks_gather_all"] == 2, p
    assert p["gathered_inside"] >= 4 * (4 * blk + root)
    assert p["after_gather_all"] == {"gathered": 0, "fallback_bytes": 0,
                                     "slots_same_memory": True, "materialized": []}
    assert p["fallbacks_after"] == 0
    # reading a released parameter fails exactly as with storages resized to 0 bytes
    assert all(p["released_read_errors"]) and p["released_read_errors"] == q["released_read_errors"]
