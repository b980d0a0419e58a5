"""From the host proxy's counts to a GPU step time (bench_host_proxy.py; docs/performance.md).

Model. The host time a run needs on the GPU machine, per phase group (pre: forward,
backward and the rest of engine.backward; post: engine.step, or clip + optimizer), from
the proxy's counts for that group, which are the same on any CPU:
    H = c_op * L + c_coll * C + c_hook * K
  L  non-view aten ops dispatched: on a GPU nearly each is a kernel launch, and with the
     Python of the model and torch.nn around it this is most of plain torch's host time
  C  collectives (engine.comm_stats() calls): on a GPU each is an NCCL launch with its
     stream/event bookkeeping and the engine's Python per bucket around it
  K  calls of hooks the engine registered (gradient hooks, stage 3's module hooks): the
     engine's Python per parameter and per unit
The device time D is plain torch's measured step time (assumed device-bound; plain torch
is a fitted point too, whose predicted ratio is below 1 if its host time exceeds D). A run
that reads a device scalar in its step (zerompi's gradient norm) cannot queue the step's
tail ahead of the device:  T = max(D, H_pre) + H_post;  without one (plain torch):
T = max(D, H_pre + H_post). Predicted ratio (tokens/s vs plain torch) = D / T.

Why counts and no time measured here: this machine's CPU times moved by 1.5-2x between
runs (cores shared with other work), and the CPU kernels of a tiny bf16 model (oneDNN
GEMMs, ~40 us each) cannot be told apart from the host overhead they stand for, so a
term in measured seconds (times a host-speed factor) made the fit unstable. The counts are
deterministic and the GPU machine's CPU gives the same ones. The measured times are in
the JSON beside them; a GPU profile with python_by_package (newer e2e.json) gives the
host-speed factor of the engine's Python there against here, reported, not used.

Fit. c_op, c_coll, c_hook minimise the squared error of the predicted ratios (plain
torch's included, measured ratio 1) against the measured ones: by default the mean over
the H100 runs under benchmarks/results/gpu/h100-2026-11-27*/ of each (preset, stage)'s
tokens/s ratio to plain torch in the same run (D: their mean plain-torch step), or the
runs given with --calibrate. A grid search (no scipy). Few points, three constants: a fit,
not a validation (the leave-one-out residuals say how much it leans on each point); the
next GPU run's numbers are the test.
"""
from __future__ import annotations

import glob
import json
from pathlib import Path

import numpy as np

from harness import ROOT

DEFAULT_RUNS = "benchmarks/results/gpu/h100-2026-11-27*/**/e2e*.json"
PRE, POST = ("forward", "backward", "after_backward"), ("step",)
STAGES = ("stage0", "stage1", "stage2", "stage3")


def measured(paths: list[Path] | None = None) -> dict:
    """{preset: {"torch_s": [...], "ratio": {stage: [...]}, "step_s": {stage: [...]},
    "profiles": {stage: profile}, "files": [...]}} from bench_gpu_e2e.py JSON files."""
    if paths is None:
        paths = [Path(p) for p in sorted(glob.glob(str(ROOT / DEFAULT_RUNS), recursive=True))]
    out: dict = {}
    for p in paths:
        d = json.loads(Path(p).read_text())
        if "systems" in d:  # bench_gpu_e2e.py's rounds layout: systems by name, ratios per round
            d = {"preset": d.get("preset"), **d["systems"], "torch_plain": d["systems"].get("torch", {})}
        plain = d.get("torch_plain", {})
        if "step_s" not in plain or not any("step_s" in d.get(s, {}) for s in STAGES):
            continue  # an offload-only file, or a failed run
        m = out.setdefault(d["preset"], {"torch_s": [], "ratio": {}, "step_s": {}, "profiles": {}, "files": []})
        m["files"].append(str(Path(p).relative_to(ROOT)) if Path(p).is_relative_to(ROOT) else str(p))
        m["torch_s"].append(plain["step_s"])
        for s in STAGES:
            if "step_s" in d.get(s, {}):
                r = d[s].get("ratio_vs_torch", {}).get("median")  # paired rounds, where measured so
                m["ratio"].setdefault(s, []).append(r if r is not None else plain["step_s"] / d[s]["step_s"])
                m["step_s"].setdefault(s, []).append(d[s]["step_s"])
                prof = d[s].get("profile")
                if isinstance(prof, dict) and prof.get("python_by_package"):
                    m["profiles"][s] = prof
    return out


FEATURES = ("launch_ops", "collectives", "hook_calls")


def features(rec: dict) -> np.ndarray:
    """[[L, C, K] pre, [L, C, K] post] of one proxy run (see the module docstring)."""
    ops, views = rec["ops_by_phase"], rec.get("view_ops_by_phase", {})
    coll, hooks = rec.get("collectives_by_phase", {}), rec.get("hooks_by_phase", {})
    return np.array([[sum(ops.get(p, 0.0) - views.get(p, 0.0) for p in g),
                      sum(coll.get(p, 0.0) for p in g),
                      sum(sum(hooks.get(p, {}).values()) for p in g)] for g in (PRE, POST)])


def synced(rec: dict) -> bool:
    """Whether the run's step waits for the device on a GPU: it reads a device scalar here
    and the engine does not defer that read there (defers_on_gpu)."""
    return rec["device_scalar_reads"] >= 1 and not rec.get("defers_on_gpu", False)


def predict_time(X: np.ndarray, synced: bool, D: float, theta) -> float:
    h_pre, h_post = X @ np.asarray(theta, float)
    return max(D, h_pre) + h_post if synced else max(D, h_pre + h_post)


def _points(result: dict, meas: dict) -> list[dict]:
    pts = []
    for preset, res in result["models"].items():
        if preset not in meas or "torch" not in res:
            continue
        D = float(np.mean(meas[preset]["torch_s"]))
        for run in ("torch",) + STAGES:
            if run not in res or (run != "torch" and run not in meas[preset]["ratio"]):
                continue
            r = res[run]
            want = 1.0 if run == "torch" else float(np.mean(meas[preset]["ratio"][run]))
            pts.append({"preset": preset, "run": run, "X": features(r), "synced": synced(r),
                        "D": D, "measured": want,
                        "runs": [] if run == "torch" else meas[preset]["ratio"][run]})
    return pts


def _ratios(pts: list[dict], thetas) -> np.ndarray:
    """Predicted ratios, (len(thetas), len(pts)), for each row (c_op, c_coll, c_hook) of thetas."""
    th = np.atleast_2d(np.asarray(thetas, float))
    out = np.empty((len(th), len(pts)))
    for j, p in enumerate(pts):
        h_pre, h_post = p["X"] @ th.T
        T = np.maximum(p["D"], h_pre) + h_post if p["synced"] else np.maximum(p["D"], h_pre + h_post)
        out[:, j] = p["D"] / T
    return out


def _grid(pts) -> tuple:
    """Coarse-to-fine grid search of (c_op, c_coll, c_hook) for the least squared ratio error."""
    want = np.array([p["measured"] for p in pts])
    axes = [np.linspace(0, 100e-6, 26), np.linspace(0, 1e-3, 26), np.linspace(0, 1e-3, 26)]
    for _ in range(6):
        th = np.stack(np.meshgrid(*axes, indexing="ij"), -1).reshape(-1, 3)
        best = th[int(np.argmin(np.sum((_ratios(pts, th) - want) ** 2, axis=1)))]
        axes = [np.clip(np.linspace(b - (ax[-1] - ax[0]) / 5, b + (ax[-1] - ax[0]) / 5, 17), 0.0, None)
                for ax, b in zip(axes, best)]
    return tuple(float(v) for v in best)


def host_speed_factor(result: dict, meas: dict) -> float | None:
    """The engine's Python (zerompi/* less the model, step_profile's python_by_package) on
    the GPU machine over the proxy's here, same preset and stage; None without profiles."""
    num = den = 0.0
    engine = lambda d: sum(v for k, v in d.items() if k.startswith("zerompi/") and k != "zerompi/models")  # noqa: E731
    for preset, m in meas.items():
        for stage, prof in m["profiles"].items():
            mine = result["models"].get(preset, {}).get(stage, {}).get("python_by_package_us")
            if mine:
                num, den = num + engine(prof["python_by_package"]), den + engine(mine)
    return num / den if den > 0 else None


def fit_and_predict(result: dict, paths: list[Path] | None = None, constants: Path | None = None) -> dict:
    """Fit the constants to this result's counts and the measured runs, or (constants: an
    earlier result's JSON) take that fit's constants: the measured runs were of the code
    that earlier result counted, and this code's counts are what is to be predicted."""
    meas = measured(paths)
    pts = _points(result, meas)
    if not any(p["run"] != "torch" for p in pts):
        return {"error": "no measured GPU run matches the proxy's models and stages"}
    if constants is not None:
        c = json.loads(constants.read_text())["fit"]["constants"]
        theta = (c["c_op_us"] * 1e-6, c["c_coll_us"] * 1e-6, c["c_hook_us"] * 1e-6)
    else:
        theta = _grid(pts)
    got = _ratios(pts, theta)[0]
    loo = []  # each zerompi point predicted by a fit to the others
    for i, p in enumerate(pts):
        if p["run"] != "torch" and constants is None:
            rest = pts[:i] + pts[i + 1:]
            loo.append(float(_ratios([p], _grid(rest))[0][0] - p["measured"]))
        else:
            loo.append(None)
    out = {"model": "T = max(D, H_pre) + H_post with a device-scalar read in the step, else max(D, H_pre + H_post); "
                    "H = c_op*L + c_coll*C + c_hook*K per phase group; ratio = D / T",
           "constants_from": str(constants) if constants is not None else "this fit",
           "constants": {"c_op_us": theta[0] * 1e6, "c_coll_us": theta[1] * 1e6, "c_hook_us": theta[2] * 1e6},
           "host_speed_factor": host_speed_factor(result, meas),
           "fitted_to": sorted({f for m in meas.values() for f in m["files"]}),
           "points": [{"preset": p["preset"], "run": p["run"], "measured_ratio": p["measured"],
                       "measured_runs": p["runs"], "predicted_ratio": float(g), "residual": float(g - p["measured"]),
                       "leave_one_out_residual": lo} for p, g, lo in zip(pts, got, loo)],
           "predicted": {}}
    out["max_abs_residual"] = max(abs(p["residual"]) for p in out["points"])
    n = sum(p["run"] != "torch" for p in pts)
    if n <= len(theta) and constants is None:  # as many constants as points: any numbers fit, nothing is tested
        out["warning"] = f"{n} measured stages for {len(theta)} constants: the fit is underdetermined"
    for preset, res in result["models"].items():
        if preset not in meas or "torch" not in res:
            continue
        D = float(np.mean(meas[preset]["torch_s"]))
        pred = {}
        for run in ("torch",) + STAGES:
            if run in res:
                X = features(res[run])
                T = predict_time(X, synced(res[run]), D, theta)
                h = X @ np.asarray(theta)
                pred[run] = {"step_s": T, "ratio": D / T, "host_pre_s": float(h[0]), "host_post_s": float(h[1]),
                             "features_pre": dict(zip(FEATURES, X[0].tolist())),
                             "features_post": dict(zip(FEATURES, X[1].tolist()))}
        out["predicted"][preset] = {"device_s": D, "runs": pred}
    return out


def report(fit: dict) -> None:
    if "error" in fit:
        print(f"fit: {fit['error']}")
        return
    c = fit["constants"]
    print(f"fit: c_op = {c['c_op_us']:.1f} us, c_coll = {c['c_coll_us']:.0f} us, c_hook = {c['c_hook_us']:.0f} us; "
          f"max |residual| {fit['max_abs_residual']:.3f}" + (f" ({fit['warning']})" if "warning" in fit else ""))
    for p in fit["points"]:
        lo = p["leave_one_out_residual"]
        print(f"  {p['preset']:7s} {p['run']:6s} measured {p['measured_ratio']:.3f} predicted "
              f"{p['predicted_ratio']:.3f} ({p['residual']:+.3f}"
              + (f"; left out {lo:+.3f})" if lo is not None else ")"))
    for preset, v in fit["predicted"].items():
        print(f"  predicted {preset}: " + ", ".join(f"{k} {r['ratio']:.2f}" for k, r in v["runs"].items()))


def plot(result: dict, path: Path) -> None:
    from harness import pyplot

    plt = pyplot()

    models = list(result["models"])
    cols = ("CPU ms/step here (median; tick: min) | predicted GPU host ms/step", "aten ops/step (non-view | view)",
            "collectives | device reads | polls in backward", "tokens/s vs plain torch (H100)")
    fig, axes = plt.subplots(len(models), 4, figsize=(18, 3.6 * len(models)), squeeze=False)
    fit = result.get("fit", {})
    for i, preset in enumerate(models):
        res = result["models"][preset]
        runs = [r for r in ("torch",) + STAGES if r in res]
        x = np.arange(len(runs))
        pred = fit.get("predicted", {}).get(preset, {}).get("runs", {})
        ax = axes[i][0]
        ax.bar(x - 0.2, [res[r].get("cpu_s", 0) * 1e3 for r in runs], 0.4, label="CPU here")
        ax.plot(x - 0.2, [res[r].get("cpu_min_s", 0) * 1e3 for r in runs], "k_", ms=10)
        ax.bar(x + 0.2, [(pred[r]["host_pre_s"] + pred[r]["host_post_s"]) * 1e3 if r in pred else 0 for r in runs],
               0.4, label="GPU host (model)")
        nv = [res[r]["ops"] - res[r]["view_ops"] for r in runs]
        axes[i][1].bar(x, nv, label="non-view")
        axes[i][1].bar(x, [res[r]["view_ops"] for r in runs], bottom=nv, label="view")
        w = 0.27
        for k, (key, lab) in enumerate((("collectives", "collectives"), ("device_scalar_reads", "reads"),
                                        ("polls_in_backward", "polls in bwd"))):
            axes[i][2].bar(x + (k - 1) * w, [res[r].get(key) or 0 for r in runs], w, label=lab)
        meas = {p["run"]: p for p in fit.get("points", []) if p["preset"] == preset}
        axes[i][3].bar(x - 0.2, [pred.get(r, {}).get("ratio", 0) for r in runs], 0.4, label="predicted")
        axes[i][3].bar(x + 0.2, [meas[r]["measured_ratio"] if r in meas else 0 for r in runs], 0.4,
                       label="measured (mean)")
        for r_i, r in enumerate(runs):
            for v in meas.get(r, {}).get("measured_runs", []):
                axes[i][3].plot(x[r_i] + 0.2, v, "k.", ms=4)
        for j, ax in enumerate(axes[i]):
            ax.set_xticks(x, runs)
            ax.set_title(f"{preset}: {cols[j]}", fontsize=9)
            ax.legend(fontsize=7)
    m = result["machine"]
    fig.suptitle(f"host proxy on {m['node']} ({m['cpu_model']}, {m['cores']} cores), zerompi {result.get('commit')}, "
                 f"N = 1; skeleton GPTs", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")
