"""DeepSpeed's own deepspeed/runtime/lr_schedules.py, as the reference for
zerompi/optim/ds_schedules.py: imported from an installed deepspeed, else read out of a
DeepSpeed wheel (ZEROMPI_DEEPSPEED_WHEEL, or .whl/deepspeed-*.whl at the repository root or
in the main checkout) and run with a stub logger (the module's only import from deepspeed;
its package __init__ needs CUDA-side dependencies). None when neither is available."""
from __future__ import annotations

import glob
import os
import sys
import types
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _wheel() -> str | None:
    env = os.environ.get("ZEROMPI_DEEPSPEED_WHEEL")
    if env:
        return env
    for d in (ROOT / ".whl", ROOT.parent / "main" / ".whl"):
        found = sorted(glob.glob(str(d / "deepspeed-*.whl")))
        if found:
            return found[-1]
    return None


def load():
    try:
        from deepspeed.runtime import lr_schedules  # noqa: PLC0415
        return lr_schedules
    except Exception:  # noqa: BLE001  (absent, or its package needs what this machine lacks)
        pass
    whl = _wheel()
    if whl is None or not os.path.isfile(whl):
        return None
    with zipfile.ZipFile(whl) as z:
        src = z.read("deepspeed/runtime/lr_schedules.py").decode()
    stub = types.ModuleType("deepspeed.utils")
    stub.logger = types.SimpleNamespace(warning=lambda *a, **k: None, info=lambda *a, **k: None)
    saved = {k: sys.modules.get(k) for k in ("deepspeed", "deepspeed.utils")}
    sys.modules["deepspeed"] = types.ModuleType("deepspeed")
    sys.modules["deepspeed.utils"] = stub
    try:
        mod = types.ModuleType("ds_lr_schedules")
        exec(compile(src, f"{whl}!deepspeed/runtime/lr_schedules.py", "exec"), mod.__dict__)
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
    mod.WHEEL = whl
    return mod
