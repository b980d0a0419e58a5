"""Checkpoints: exact resume, resharding across world sizes and stages, HDF5 tools, and
the inspect/export command lines (damaged checkpoints: test_checkpoint_faults.py; crash
safety: tests/system/test_checkpoint_crash.py; shared jobs and readers:
tests/support/checkpoint_cases.py; the format's pure helpers: tests/unit/test_checkpoint_format.py).

Every multi-rank case runs `mpiexec -n N python -m mpi4py tests/workers/ckpt_*.py` with
a timeout (tests/support/mpirun.py), so a rank stuck in a collective fails the test instead of
hanging CI. The data of step s is global_batch(s), and client_state carries the data
position, so a job started from a checkpoint continues exactly where the saver stopped.
"""
import json
import os
import re
import shutil
import subprocess
import sys

import h5py
import numpy as np
import pytest

from checkpoint_cases import KINDS, full_state, max_diff, read_dump, train_job
from mpirun import ROOT
from zerompi.checkpoint import naming


# ---------------------------------------------------------------------------- resume
def test_resume_is_bitwise_exact(ckpt_base, tmp_path):
    """6 steps == 3 steps, save, load in a NEW mpiexec job, 3 steps: bitwise, at stages
    0, 1, 2, 3 in fp32 and stage 2 in bf16 (same world size and stage: same arithmetic in
    the same order, so there is nothing to tolerate). RNG states come back per rank."""
    d = ckpt_base["dir"]
    runs = [{"model": m, "stage": s, "precision": p, "plan": [
        ["load", str(d / key), None], ["rng", "after-load"], ["train", 3], ["dump", str(tmp_path / f"{key}.h5")]]}
        for key, (m, s, p) in ckpt_base["cases"].items()]
    res = train_job(2, runs, tmp_path, "resume")
    assert len(res["runs"]) == len(ckpt_base["cases"])
    for key, out in zip(ckpt_base["cases"], res["runs"]):
        assert out[0]["client_state"] == {"data_step": 3, "note": "ckpt test"}
        assert (out[0]["global_steps"], out[0]["micro_steps"]) == (3, 6)
        assert out[1]["draws"] == ckpt_base["runs"][key][3]["draws"], key  # every rank's RNG restored
        full, resumed = read_dump(d / f"{key}-full.h5"), read_dump(tmp_path / f"{key}.h5")
        assert max_diff(full, resumed) == 0.0, key


def test_keep_last_and_client_state_errors(ckpt_base):
    misc = ckpt_base["runs"]["misc"]
    rot = ckpt_base["dir"] / "rot"
    assert sorted(e for e in os.listdir(rot) if not e.startswith(".")) == ["latest", "step-2", "step-3"]
    assert (rot / "latest").read_text().strip() == "step-3"
    errors = misc[-1]["errors"]
    assert len(errors) == 2 and all(e and "client_state['sampler']['obj']: object" in e for e in errors), errors
    assert not (ckpt_base["dir"] / "bad-cs").exists() or not any((ckpt_base["dir"] / "bad-cs").iterdir())


# ---------------------------------------------------------------------------- resharding
@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """Checkpoints after 3 steps at N in {1, 2, 4} x stage in {1, 2} (and stage 3 at N=2),
    and each of those runs continued without interruption to step 6 (the references)."""
    d = tmp_path_factory.mktemp("shard")
    saved = [(n, s) for n in (1, 2, 4) for s in (1, 2)] + [(2, 3)]
    for n in (1, 2, 4):
        runs = [{"model": "odd", "stage": s, "plan": [
            ["train", 3], ["save", str(d / f"n{n}s{s}"), None], ["train", 3], ["dump", str(d / f"ref-n{n}s{s}.h5")]]}
            for m, s in saved if m == n]
        train_job(n, runs, d, f"save-n{n}")
    refs = {(n, s): read_dump(d / f"ref-n{n}s{s}.h5") for n, s in saved}
    # Reduction-order floor: the same 6 steps at another world size differ only in how
    # the gradient sums are grouped (per-rank micro-batch means, then across ranks).
    floor = max(max_diff(refs[a], refs[b]) for a in refs for b in refs if a[1] == b[1] and a[1] < 3)
    return {"dir": d, "refs": refs, "floor": floor}


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_reshard(n, sharded, ckpt_base, tmp_path):
    """Load checkpoints saved at other world sizes / stages (at N=3 also into stages 0
    and 3, and from stage-0 and stage-3 checkpoints), then:
    (a) save again at once: every tensor of every kind and the step counters equal the
        source bitwise (loading only moves fp32 values between owners, no arithmetic);
    (b) train 3 more steps: parameters equal the uninterrupted source run up to the
        reduction-order floor. The resumed run regroups the gradient sums of 3 steps,
        the floor (two uninterrupted runs at different N) regroups all 6, so the
        resumed difference stays within it; 2x leaves room for Adam amplifying
        last-bit differences of near-zero gradients differently."""
    d = sharded["dir"]
    sources = [(m, s) for m in (1, 2, 4) for s in (1, 2) if m != n] + ([(n, 1), (n, 2)] if n != 3 else [])
    combos = [(src, 3 - src[1]) for src in sources]  # always into the other stage
    if n == 3:  # also into stages 0 and 3, and from stage-0 (all in rank 0's file) and stage-3 saves
        combos += [((2, 2), 2), ((4, 1), 0), ((1, 2), 0), ((2, 0), 2), ((2, 3), 1), ((4, 2), 3)]
    src_dir = lambda m, s: ckpt_base["dir"] / "s0" if s == 0 else d / f"n{m}s{s}"  # noqa: E731
    refs = {**sharded["refs"], (2, 0): read_dump(ckpt_base["dir"] / "s0-full.h5")}
    runs = []
    for (m, s), t in combos:
        out = tmp_path / f"from-n{m}s{s}-to-s{t}"
        runs.append({"model": "odd", "stage": t, "plan": [
            ["load", str(src_dir(m, s)), None], ["save", str(out), "reloaded"], ["train", 3],
            ["dump", str(out) + "-final.h5"]]})
    res = train_job(n, runs, tmp_path, f"load-n{n}", timeout=300)
    assert len(res["runs"]) == len(combos)  # zip below must not drop a combination
    floor = sharded["floor"]
    # The floor must be rounding noise (measured: 2.4e-7), not a model difference: one
    # near the size of an Adam step (lr = 1e-2) would make the tolerance below meaningless.
    assert 0.0 <= floor < 1e-5, floor
    worst = 0.0
    for ((m, s), t), outs in zip(combos, res["runs"]):
        out = tmp_path / f"from-n{m}s{s}-to-s{t}"
        assert len(outs) == 4, outs
        assert outs[0] == {"client_state": {"data_step": 3, "note": "ckpt test"}, "global_steps": 3,
                           "micro_steps": 6}, (m, s, t, outs[0])
        assert outs[1] == {"path": str(out / "reloaded")}, (m, s, t, outs[1])
        assert outs[2] == {"global_steps": 6}, (m, s, t, outs[2])  # 3 more steps really ran
        src_m, src = full_state(src_dir(m, s) / "step-3")
        new_m, new = full_state(tmp_path / f"from-n{m}s{s}-to-s{t}" / "reloaded")
        assert new_m["world_size"] == n and new_m["stage"] == t
        assert new_m["counters"] == src_m["counters"]
        for kind in KINDS:
            for name in src[kind]:
                assert np.array_equal(src[kind][name], new[kind][name]), (m, s, t, kind, name)
        with h5py.File(src_dir(m, s) / "step-3" / naming.rank_file(0)) as a, \
                h5py.File(tmp_path / f"from-n{m}s{s}-to-s{t}" / "reloaded" / naming.rank_file(0)) as b:
            assert json.loads(a["optimizer"].attrs["steps"]) == json.loads(b["optimizer"].attrs["steps"])
        diff = max_diff(refs[(m, s)], read_dump(tmp_path / f"from-n{m}s{s}-to-s{t}-final.h5"))
        worst = max(worst, diff)
        assert diff <= 2 * floor + 1e-7, (m, s, t, diff, floor)
    assert worst <= 2 * floor + 1e-7, (worst, floor)
    print(f"N={n}: worst resumed diff {worst:.3g}, floor {floor:.3g}")


# ---------------------------------------------------------------------------- HDF5 tools
def _h5dump_values(path, dataset):
    out = subprocess.run(["h5dump", "-m", "%.9g", "-d", dataset, str(path)],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    m = re.search(r"DATASPACE\s+(SCALAR|SIMPLE \{ \( ([\d, ]+) \))", out)
    shape = () if m.group(1) == "SCALAR" else tuple(int(x) for x in m.group(2).split(","))
    body = out[out.index("DATA {") + 6:]
    body = body[:body.index("}")]
    body = re.sub(r"\(\d+(,\d+)*\):", " ", body)
    # %.9g prints enough digits for every fp32 value to parse back to the same fp32
    vals = np.array([float(v) for v in body.replace(",", " ").split()], dtype=np.float32)
    return vals.reshape(shape)


@pytest.mark.skipif(shutil.which("h5dump") is None or shutil.which("h5ls") is None,
                    reason="h5ls/h5dump missing (Debian hdf5-tools; .ci/install_debian.sh hdf5-tools)")
def test_h5ls_h5dump_read_full_tensors(ckpt_base):
    """Plain HDF5 tools see every tensor at its full shape through index.h5, with the
    values the rank files hold (bitwise: %.9g round-trips fp32), and the bf16 copy in
    its custom float type prints real numbers."""
    for key, lowp in (("s1", None), ("bf16", "param_bf16")):
        ckpt = ckpt_base["dir"] / key / "step-3"
        m, state = full_state(ckpt)
        listing = subprocess.run(["h5ls", "-r", str(ckpt / "index.h5")], capture_output=True, text=True,
                                 timeout=60, check=True).stdout
        for kind in KINDS + ((lowp,) if lowp else ()):
            for name, t in m["tensors"].items():
                shape = "{" + (", ".join(map(str, t["shape"])) or "SCALAR") + "}"
                assert re.search(rf"^/{kind}/{re.escape(name)}\s+Dataset {re.escape(shape)}", listing, re.M), \
                    (kind, name, shape)
        names = list(m["tensors"])[:3] + ["scale"] * (key == "s1")
        for name in names:
            for kind in KINDS:
                got = _h5dump_values(ckpt / "index.h5", f"/{kind}/{name}")
                assert got.shape == state[kind][name].shape
                assert np.array_equal(got, state[kind][name]), (key, kind, name)
            if lowp:
                import torch
                want = torch.from_numpy(state["param"][name]).to(torch.bfloat16).float().numpy()
                got = _h5dump_values(ckpt / "index.h5", f"/{lowp}/{name}")
                assert np.array_equal(got, want), name
                assert "16-bit little-endian floating-point" in subprocess.run(
                    ["h5dump", "-H", "-d", f"/{lowp}/{name}", str(ckpt / "index.h5")],
                    capture_output=True, text=True, check=True).stdout
        with h5py.File(ckpt / "index.h5") as f:  # and h5py reads the same through the VDS
            for name in m["tensors"]:
                assert np.array_equal(f["param"][name][()], state["param"][name])
            if lowp:
                assert f[lowp][names[0]].dtype == np.float32


# ---------------------------------------------------------------------------- CLIs
def test_inspect_cli(ckpt_base):
    ckpt = ckpt_base["dir"] / "s2"
    p = subprocess.run([sys.executable, "-m", "zerompi.inspect", str(ckpt), "--verify", "--tensor", "emb.weight",
                        "--tensor", "mask"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    out = p.stdout
    for needle in ("tag step-3", "step 3 (micro-steps 6", "world size 2  stage 2  precision fp32",
                   "emb.weight", "[37, 13]", "r0[", "r1[", "verify: OK", "rank-00001.h5",
                   "frozen.weight", "mask", "tied (stored once): head.weight -> emb.weight"):
        assert needle in out, (needle, out)
    at3 = read_dump(ckpt_base["dir"] / "s2-at3.h5")["emb.weight"].astype(np.float64)
    line = next(ln for ln in out.splitlines() if ln.startswith("param/emb.weight:"))
    st = dict(re.findall(r"(\w+) (-?[\d.e+-]+)", line))
    for key, want in (("min", at3.min()), ("max", at3.max()), ("mean", at3.mean()), ("std", at3.std()),
                      ("norm", np.linalg.norm(at3))):
        assert abs(float(st[key]) - want) <= 1e-6 * max(1.0, abs(want)), (key, st[key], want)
    assert "module/mask: numel 13  min 1  max 1" in out
    p = subprocess.run([sys.executable, "-m", "zerompi.inspect", str(ckpt), "--tensor", "nope"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and "no tensor 'nope'" in p.stderr


@pytest.mark.parametrize("key", ["s2", "bf16"])
def test_export_round_trip(ckpt_base, tmp_path, key):
    """export = engine.full_state_dict() at the time of the save (fp32 bitwise; bf16
    export = the fp32 values rounded to bf16), plus buffers; both formats agree."""
    import torch

    from zerompi.export import read_safetensors_header

    want = read_dump(ckpt_base["dir"] / f"{key}-at3.h5")
    for dtype in ("fp32", "bf16"):
        out = tmp_path / dtype
        p = subprocess.run([sys.executable, "-m", "zerompi.export", str(ckpt_base["dir"] / key), str(out),
                            "--dtype", dtype, "--format", "both"], cwd=ROOT, capture_output=True, text=True,
                           timeout=120)
        assert p.returncode == 0, p.stderr
        pt = torch.load(out / "model.pt", weights_only=True)
        header, start = read_safetensors_header(str(out / "model.safetensors"))
        raw = (out / "model.safetensors").read_bytes()
        for name, t in want.items():
            ref = torch.from_numpy(np.asarray(t))
            ref = ref.to(torch.bfloat16) if dtype == "bf16" else ref
            assert torch.equal(pt[name], ref), (dtype, name)
            h = header[name]
            a, b = h["data_offsets"]
            st = torch.frombuffer(bytearray(raw[start + a:start + b]), dtype=ref.dtype).view(h["shape"]) \
                if b > a else torch.empty(h["shape"], dtype=ref.dtype)
            assert torch.equal(st, ref), (dtype, name)
        extra = set(pt) - set(want)
        aliases = json.loads((out / "export.json").read_text())["aliases"]
        assert extra == ({"mask"} if key == "s2" else set()) | set(aliases), extra
        for alias, target in aliases.items():  # tied names share one storage in model.pt
            assert pt[alias].data_ptr() == pt[target].data_ptr()
        try:  # the reference reader, when installed, agrees with the hand-written format
            from safetensors.torch import load_file
        except ImportError:
            continue
        lib = load_file(str(out / "model.safetensors"))
        assert lib.keys() == pt.keys() and all(torch.equal(lib[k], pt[k]) for k in lib)
