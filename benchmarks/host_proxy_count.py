"""What the host proxy counts in a training step, from outside the engine:

  ops     aten ops dispatched (a TorchDispatchMode: autocast's casts and backward's ops too),
          by name and phase; on a GPU nearly each is a kernel launch
  copies  copy_ and _to_copy by (source dtype, destination dtype)
  reads   device-scalar reads (aten::_local_scalar_dense) by call site: a host sync on a
          GPU. Reads of host-born tensors (torch.tensor of Python numbers and what is
          computed from them alone) are told apart as host_reads; the fused optimizer's
          norm, host-born here, counts as the device tensor it is on a GPU
  polls   Handle.test / Handle.wait calls by phase: on NCCL a test is a cudaEventQuery
  hooks   calls of hooks registered while `instrumented` is active
  phases  forward | backward (inside autograd, torch.autograd.backward wrapped) |
          after_backward | step
The optimizer's NumpyExecutor (the CPU's stand-in for the GPU's kernels) is device work on a
GPU: replaced by a stand-in that skips the update and computes the norm with one numpy dot.
Not seen: .tolist()/.cpu()/.numpy() of a device tensor (a sync on a GPU) dispatch nothing on
a CPU tensor."""
from __future__ import annotations

import contextlib
import inspect
import sys
from collections import Counter, defaultdict

import numpy as np
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakTensorKeyDictionary

aten = torch.ops.aten
PHASES = ("forward", "backward", "after_backward", "step")


class Record:
    """Counts of one or more steps by phase (`phase`, set by the step and by autograd)."""

    def __init__(self) -> None:
        self.phase, self.active = "idle", False
        self.reset()

    def set_phase(self, name: str) -> None:
        self.phase = name

    def reset(self) -> None:
        self.ops: dict[str, Counter] = defaultdict(Counter)       # phase -> op name -> calls
        self.views: Counter = Counter()                           # phase -> view ops
        self.copies: Counter = Counter()                          # "src->dst" -> calls
        self.reads: Counter = Counter()                           # call site -> device-scalar reads
        self.host_reads: Counter = Counter()
        self.polls: dict[str, Counter] = defaultdict(Counter)    # phase -> "Class.test|wait" -> calls
        self.hooks = 0

    def summary(self, steps: int) -> dict:
        per = lambda c: {k: v / steps for k, v in c.most_common()}  # noqa: E731
        allops = sum(self.ops.values(), Counter())
        polls = {p: sum(c.values()) / steps for p, c in self.polls.items()}
        return {"ops": sum(allops.values()) / steps, "view_ops": sum(self.views.values()) / steps,
                "ops_by_phase": {p: sum(self.ops[p].values()) / steps for p in PHASES if p in self.ops},
                "ops_by_name": dict(list(per(allops).items())[:30]),
                "copies": sum(self.copies.values()) / steps, "copies_by_dtype": per(self.copies),
                "device_scalar_reads": sum(self.reads.values()) / steps, "reads_by_site": per(self.reads),
                "host_scalar_reads": sum(self.host_reads.values()) / steps,
                "polls_by_phase": polls, "polls_in_backward": polls.get("backward", 0.0),
                "poll_calls": {p: per(c) for p, c in self.polls.items()}, "hook_calls": self.hooks / steps}


REC = Record()
_HOST = WeakTensorKeyDictionary()   # host-born tensors (see the module docstring)


def _site() -> str:
    """file:line of the innermost frame outside torch and this file: who read the scalar."""
    f = sys._getframe(2)
    while f is not None:
        fn = f.f_code.co_filename
        if "torch" + "/" not in fn and not fn.endswith(("host_proxy_count.py", "_python_dispatch.py")):
            i = fn.find("zerompi/")
            return f"{fn[i:] if i >= 0 else fn.rsplit('/', 1)[-1]}:{f.f_lineno}({f.f_code.co_name})"
        f = f.f_back
    return "?"


def _tensors(xs) -> list:
    """The tensors among xs and one level of lists in it (aten's argument shapes)."""
    out = []
    for x in xs:
        out += [x] if isinstance(x, torch.Tensor) else \
            [y for y in x if isinstance(y, torch.Tensor)] if isinstance(x, (list, tuple)) else []
    return out


def _dt(x) -> str:
    return str(x.dtype if isinstance(x, torch.Tensor) else x).replace("torch.", "")


class OpCounter(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs, rec = kwargs or {}, REC
        out = func(*args, **kwargs)
        rec.ops[rec.phase][func.name()] += 1
        rec.views[rec.phase] += bool(getattr(func, "is_view", False))  # aliases its input, writes nothing
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


def _backward(orig):
    """torch.autograd.backward marking the backward phase (Tensor.backward calls it)."""
    def backward(*a, **k):
        prev = REC.phase
        REC.set_phase("backward")
        try:
            return orig(*a, **k)
        finally:
            REC.set_phase(prev)
    return backward


def _registrar(orig):
    """A hook registration whose hook counts its calls."""
    def register(self, hook, *a, **k):
        def counted(*ha, **hk):
            REC.hooks += REC.active
            return hook(*ha, **hk)
        return orig(self, counted, *a, **k)
    return register


def _counted_method(cls, name: str, orig):
    key = f"{cls.__name__}.{name}"

    def method(self, *a, **k):
        if REC.active:
            REC.polls[REC.phase][key] += 1
        return orig(self, *a, **k)
    return method


def _handle_classes():
    from zerompi.comm import base

    with contextlib.suppress(Exception):  # NCCL's handle where its module imports (cupy lazily)
        from zerompi.comm import nccl  # noqa: F401
    out, todo = [], [base.Handle]
    while todo:
        out.append(todo.pop())
        todo += out[-1].__subclasses__()
    return out


def _fast_adamw(self, rows) -> None:
    """The update is device work on a GPU: skipped."""


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


def _on_device(fn):
    """An executor method whose result is a device tensor on a GPU (the norm): not host-born."""
    def method(self, *a, **k):
        out = fn(self, *a, **k)
        if isinstance(out, torch.Tensor):
            _HOST.pop(out, None)
        return out
    return method


@contextlib.contextmanager
def instrumented():
    """For the whole run (engine construction included): hooks registered meanwhile are
    counted, Handle.test/wait are counted, autograd marks its phase, the executor's kernels
    are stand-ins. Counting happens only while REC.active (the counted steps)."""
    new = [(torch.autograd, "backward", _backward(torch.autograd.backward))]
    for owner, name in ((torch.Tensor, "register_hook"), (torch.Tensor, "register_post_accumulate_grad_hook"),
                        (nn.Module, "register_forward_pre_hook"), (nn.Module, "register_forward_hook")):
        new.append((owner, name, _registrar(getattr(owner, name))))
    for cls in _handle_classes():
        new += [(cls, n, _counted_method(cls, n, vars(cls)[n])) for n in ("test", "wait") if n in vars(cls)]
    try:
        from zerompi.optim.fused_adamw import NumpyExecutor
    except ImportError:
        NumpyExecutor = None
    for name, (fast, params) in _STAND_INS.items() if NumpyExecutor is not None else ():
        if name in vars(NumpyExecutor):  # the stand-in only where the interface is the one it mimics
            exact = vars(NumpyExecutor)[name]
            STAND_IN[name] = "fast" if list(inspect.signature(exact).parameters) == params else "exact"
            new.append((NumpyExecutor, name, _on_device(fast if STAND_IN[name] == "fast" else exact)))
    saved = []
    for owner, name, fn in new:
        saved.append((owner, name, vars(owner)[name]))
        setattr(owner, name, fn)
    try:
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
