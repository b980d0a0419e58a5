"""What the host proxy counts in a training step, from outside the engine:

  ops     aten ops dispatched (a TorchDispatchMode: autocast's casts and backward's ops too),
          by name and phase; on a GPU nearly each is a kernel launch
  copies  copy_ and _to_copy by (source dtype, destination dtype)
  reads   device-scalar reads (aten::_local_scalar_dense) by call site: a host sync on a
          GPU. Host-born tensors (torch.tensor of Python numbers and what is computed from
          them alone) are told apart as host_reads; so is the fused optimizer's norm, a host
          tensor here but a device one on a GPU (mark_device)
  polls   Handle.test / Handle.wait calls by phase: on NCCL a test is a cudaEventQuery
  hooks   calls of hooks registered while `instrumented` is active, by what they call
  phases  forward | backward (inside autograd, torch.autograd.backward wrapped) |
          after_backward | step; wall and CPU seconds by phase always, and while counting
          the CPU seconds inside non-view ops (a diagnostic: inflated by the counting)
The optimizer's NumpyExecutor (the CPU's stand-in for the GPU's kernels) is device work on a
GPU: timed apart and replaced by a stand-in that skips the update and computes the norm
with one numpy dot. Not seen: .tolist()/.cpu()/.numpy() of a device tensor (a sync on a
GPU) dispatch nothing on a CPU tensor."""
from __future__ import annotations

import contextlib
import inspect
import sys
import time
from collections import Counter, defaultdict

import numpy as np
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakTensorKeyDictionary

aten = torch.ops.aten
PHASES = ("forward", "backward", "after_backward", "step")


class Record:
    """Counts of one or more steps, and wall time by phase (set_phase, always on)."""

    def __init__(self) -> None:
        self.phase, self.active, self.on_switch = "idle", False, None
        self.wall: Counter = Counter()     # phase -> seconds
        self.cpu: Counter = Counter()      # phase -> process CPU seconds
        self.stand_in_s = 0.0              # NumpyExecutor's time (a GPU kernel's work)
        self._t, self._c = time.perf_counter(), time.process_time()
        self.reset()

    def set_phase(self, name: str) -> None:
        now, cnow = time.perf_counter(), time.process_time()
        self.wall[self.phase] += now - self._t
        self.cpu[self.phase] += cnow - self._c
        self._t, self._c = now, cnow
        if self.on_switch is not None:
            self.on_switch(self.phase)
        self.phase = name

    def reset(self) -> None:
        self.ops: dict[str, Counter] = defaultdict(Counter)       # phase -> op name -> calls
        self.views: Counter = Counter()                           # phase -> view ops
        self.copies: Counter = Counter()                          # "src->dst" -> calls
        self.reads: Counter = Counter()                           # call site -> device-scalar reads
        self.host_reads: Counter = Counter()
        self.polls: dict[str, Counter] = defaultdict(Counter)    # phase -> "Class.test|wait" -> calls
        self.hooks: dict[str, Counter] = defaultdict(Counter)    # phase -> label -> calls
        self.kernel_s: Counter = Counter()                        # phase -> CPU s in non-view ops
        self.kernel_by_op: Counter = Counter()                    # op name -> CPU s

    def summary(self, steps: int) -> dict:
        per = lambda c: {k: v / steps for k, v in sorted(c.items(), key=lambda kv: -kv[1])}  # noqa: E731
        by_phase = {p: sum(self.ops[p].values()) / steps for p in PHASES if p in self.ops}
        allops = Counter()
        for c in self.ops.values():
            allops.update(c)
        polls = {p: sum(c.values()) / steps for p, c in self.polls.items()}
        views = {p: self.views[p] / steps for p in PHASES if p in self.views}
        return {"ops": sum(allops.values()) / steps, "view_ops": sum(self.views.values()) / steps,
                "ops_by_phase": by_phase, "view_ops_by_phase": views, "ops_by_name": per(allops),
                "kernel_cpu_s": sum(self.kernel_s.values()) / steps,
                "kernel_cpu_s_by_phase": {p: self.kernel_s[p] / steps for p in PHASES if p in self.kernel_s},
                "kernel_cpu_us_by_op": {k: v / steps * 1e6 for k, v in self.kernel_by_op.most_common(12)},
                "copies": sum(self.copies.values()) / steps, "copies_by_dtype": per(self.copies),
                "device_scalar_reads": sum(self.reads.values()) / steps, "reads_by_site": per(self.reads),
                "host_scalar_reads": sum(self.host_reads.values()) / steps,
                "polls_by_phase": polls, "polls_in_backward": polls.get("backward", 0.0),
                "poll_calls": {p: per(c) for p, c in self.polls.items()},
                "hook_calls": sum(sum(c.values()) for c in self.hooks.values()) / steps,
                "hooks_by_phase": {p: per(c) for p, c in self.hooks.items()}}


REC = Record()
_HOST = WeakTensorKeyDictionary()   # host-born tensors (see the module docstring)


def mark_device(t):
    """`t` stands for a device tensor of the GPU run (the fused optimizer's norm)."""
    if isinstance(t, torch.Tensor):
        _HOST.pop(t, None)
    return t


def _site() -> str:
    """file:line of the innermost frame outside torch and this file: who read the scalar."""
    f = sys._getframe(2)
    while f is not None:
        fn = f.f_code.co_filename
        if "torch" + "/" not in fn and not fn.endswith(("host_proxy_count.py", "_python_dispatch.py")):
            i = fn.find("zerompi/")
            short = fn[i:] if i >= 0 else fn.rsplit("/", 1)[-1]
            return f"{short}:{f.f_lineno}({f.f_code.co_name})"
        f = f.f_back
    return "?"


class OpCounter(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        rec = REC
        if _is_view(func):
            out = func(*args, **kwargs)
            rec.views[rec.phase] += 1
        else:
            c0 = time.process_time()
            out = func(*args, **kwargs)
            dt = time.process_time() - c0
            rec.kernel_s[rec.phase] += dt
            rec.kernel_by_op[func.name()] += dt
        rec.ops[rec.phase][func.name()] += 1
        if func is aten.copy_.default:
            rec.copies[f"{_dt(args[1])}->{_dt(args[0])}"] += 1
        elif func is aten._to_copy.default:
            rec.copies[f"{_dt(args[0])}->{_dt(kwargs.get('dtype') or args[0].dtype)}"] += 1
        ins = _tensors(args) + _tensors(kwargs.values())
        host = func is aten.lift_fresh.default or (ins and all(a in _HOST for a in ins))
        if func is aten._local_scalar_dense.default:
            (rec.host_reads if host else rec.reads)[_site()] += 1
        elif host:
            for o in _tensors(out if isinstance(out, (tuple, list)) else (out,)):
                _HOST[o] = True
        return out


_VIEWS: dict = {}


def _is_view(func) -> bool:
    """An op whose output aliases its input without writing it (OpOverload.is_view, or
    its schema where a torch lacks the attribute)."""
    v = _VIEWS.get(func)
    if v is None:
        v = getattr(func, "is_view", None)
        if v is None:
            v = any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)
        _VIEWS[func] = v
    return v


def _tensors(xs) -> list:
    """The tensors among xs and one level of lists in it (aten's argument shapes)."""
    out = []
    for x in xs:
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, (list, tuple)):
            out += [y for y in x if isinstance(y, torch.Tensor)]
    return out


def _dt(x) -> str:
    d = x.dtype if isinstance(x, torch.Tensor) else x
    return str(d).replace("torch.", "")


@contextlib.contextmanager
def phase_marks():
    """torch.autograd.backward marks the backward phase (Tensor.backward calls it)."""
    orig = torch.autograd.backward

    def backward(*a, **k):
        prev = REC.phase
        REC.set_phase("backward")
        try:
            return orig(*a, **k)
        finally:
            REC.set_phase(prev)
    torch.autograd.backward = backward
    try:
        yield
    finally:
        torch.autograd.backward = orig


def _label(fn) -> str:
    for cell in getattr(fn, "__closure__", None) or ():
        v = cell.cell_contents
        if callable(v) and hasattr(v, "__qualname__") and not isinstance(v, type):
            return v.__qualname__
    return getattr(fn, "__qualname__", type(fn).__name__)


def _counting(kind: str, fn):
    label = f"{kind}:{_label(fn)}"

    def hook(*a, **k):
        if REC.active:
            REC.hooks[REC.phase][label] += 1
        return fn(*a, **k)
    return hook


_REGISTRARS = [(torch.Tensor, "register_hook", "tensor"),
               (torch.Tensor, "register_post_accumulate_grad_hook", "post_accumulate_grad"),
               (nn.Module, "register_forward_pre_hook", "forward_pre"),
               (nn.Module, "register_forward_hook", "forward")]


def _handle_classes():
    from zerompi.comm import base

    try:  # NCCL's handle where cupy is importable; its module imports cupy lazily anyway
        from zerompi.comm import nccl  # noqa: F401
    except Exception:  # noqa: BLE001
        pass
    out, todo = [], [base.Handle]
    while todo:
        c = todo.pop()
        out.append(c)
        todo += c.__subclasses__()
    return out


def _counted_method(cls, name: str, orig):
    key = f"{cls.__name__}.{name}"

    def method(self, *a, **k):
        if REC.active:
            REC.polls[REC.phase][key] += 1
        return orig(self, *a, **k)
    return method


def _fast_adamw(self, rows) -> None:
    """The update is device work on a GPU: skipped (see the module docstring)."""


def _fast_norm(self, weights):
    """The squared norm of the stored gradient, +inf if any element is not finite (with
    tp = 1 every segment's weight is 1 and padding is zero, so it is the whole buffer's)."""
    g = self.a["grad"].reshape(-1)
    x = (g.astype(np.uint32) << 16).view(np.float32) if g.dtype == np.uint16 else g.astype(np.float32)
    with np.errstate(all="ignore"):
        s = float(np.dot(x, x))
    return torch.tensor(s if np.isfinite(s) else float("inf"), dtype=torch.float64)


_STAND_INS = {"adamw": (_fast_adamw, ["self", "rows"]), "grad_sq_norm": (_fast_norm, ["self", "weights"])}
STAND_IN: dict = {}   # executor method -> "fast" | "exact": what the last run used


def _stand_in(orig):
    """NumpyExecutor (the CPU's stand-in for the GPU's CupyExecutor kernels): its time is
    device work on a GPU, so it is timed apart; its norm is a device tensor there."""
    def method(self, *a, **k):
        c0 = time.process_time()
        try:
            return mark_device(orig(self, *a, **k))
        finally:
            REC.stand_in_s += time.process_time() - c0
    return method


@contextlib.contextmanager
def instrumented(fast: bool = True):
    """For the whole run (engine construction included): hooks registered meanwhile are
    counted, Handle.test/wait are counted, autograd marks its phase. Counting happens
    only while REC.active (the counted steps), so timed steps pay one flag test a call."""
    saved = []
    for owner, name, kind in _REGISTRARS:
        orig = getattr(owner, name)

        def register(self, hook, *a, _orig=orig, _kind=kind, **k):
            return _orig(self, _counting(_kind, hook), *a, **k)
        saved.append((owner, name, orig))
        setattr(owner, name, register)
    for cls in _handle_classes():
        for name in ("test", "wait"):
            if name in vars(cls):
                saved.append((cls, name, vars(cls)[name]))
                setattr(cls, name, _counted_method(cls, name, vars(cls)[name]))
    try:
        from zerompi.optim.fused_adamw import NumpyExecutor
    except ImportError:
        NumpyExecutor = None
    for name in ("adamw", "grad_sq_norm") if NumpyExecutor is not None else ():
        if name in vars(NumpyExecutor):
            exact = vars(NumpyExecutor)[name]
            saved.append((NumpyExecutor, name, exact))
            # the fast stand-in only where the executor's interface is the one it mimics
            quick = fast and list(inspect.signature(exact).parameters) == _STAND_INS[name][1]
            STAND_IN[name] = "fast" if quick else "exact"
            setattr(NumpyExecutor, name, _stand_in(_STAND_INS[name][0] if quick else exact))
    try:
        with phase_marks():
            yield REC
    finally:
        for owner, name, orig in reversed(saved):
            setattr(owner, name, orig)


@contextlib.contextmanager
def counting():
    """Count ops, reads, polls and hook calls of the steps run inside."""
    REC.reset()
    REC.active = True
    try:
        with OpCounter():
            yield REC
    finally:
        REC.active = False
