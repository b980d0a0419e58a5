"""Parameters built under `zerompi.Init`: partitioned, yet correct under any op.

Why a Parameter subclass, and why lazily. Model code initialises parameters in every way
torch allows: torch.nn.init functions (also imported by name, or captured in a table as
transformers 5 does), in-place tensor methods (`p.data.normal_()`, `w[pad].fill_(0)`),
`copy_` from a state dict, deep copies of whole layers (nn.TransformerEncoder). Redirecting
a list of functions misses some of these, and a parameter over an empty storage then
crashes (or is silently written out of bounds). Instead every registered parameter
becomes a `ZeroInitParameter` (its class swapped in place, as torch's
UninitializedParameter.materialize does) whose `__torch_function__` sees every op:

- metadata queries (shape, dtype, numel, requires_grad_, hooks, new_empty, ...) pass
  through without data: the parameter keeps its shape over a 0-byte storage;
- inside the Init block, any other op first makes the parameter full: by one all-gather
  of the pieces, or, for ops that overwrite it entirely (`normal_`, `fill_`, `copy_`,
  `p.data = t`, nn.init functions), by a fresh allocation without communication. The op
  then runs on the full tensor exactly as without Init, so values and random-number
  consumption are bitwise the same. Construction code is deterministic and the same on
  every rank, so every rank issues the same gathers in the same order;
- outside the Init block (and outside GatheredParameters) such an op raises an error
  naming the parameter, its module and zerompi, instead of touching an empty storage.

Full parameters sit in a small LRU (`keep_full`, default 8 parameters): a module's own
__init__ usually touches its parameters right after registering them (Linear's
reset_parameters, MultiheadAttention's _reset_parameters, Embedding's padding row), so
they are partitioned only when pushed out, and rarely gathered again. Partitioning
(keeping this rank's 1/N piece) needs no communication, since every rank holds the same
full values. A parameter whose storage is still shared with a live view (`v = p[0]`) is
not partitioned until the view dies, so writes through the view are never lost; at
Init exit everything is partitioned (a view kept past the block no longer reaches it). Every rank logs the ops it runs on parameters and
its RNG state; at exit the logs are compared, so ranks that built differently fail
naming the first differing op instead of holding a mix of two models.
"""
from __future__ import annotations

import weakref

import torch
import torch.nn as nn
from torch._C import DisableTorchFunctionSubclass

ACTIVE: list = []  # init_context.Session of each open Init block; the innermost caches and logs
PARENT: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # module -> (parent ref, name)

_T = torch.Tensor
_META = {getattr(_T, n).__get__ for n in (
    "shape", "dtype", "device", "requires_grad", "is_leaf", "grad", "grad_fn", "layout", "ndim",
    "is_cuda", "is_cpu", "is_sparse", "is_quantized", "is_meta", "is_mkldnn", "names", "_base",
    "output_nr", "itemsize", "nbytes", "_version", "_backward_hooks", "_post_accumulate_grad_hooks")
    if hasattr(_T, n)}
_META |= {getattr(_T, n).__set__ for n in ("requires_grad", "grad", "_backward_hooks",
                                            "_post_accumulate_grad_hooks") if hasattr(_T, n)}
_META |= {getattr(_T, n) for n in (
    "size", "dim", "ndimension", "numel", "nelement", "element_size", "is_floating_point",
    "is_complex", "is_signed", "stride", "is_contiguous", "requires_grad_", "register_hook",
    "register_post_accumulate_grad_hook", "__len__", "get_device", "new_empty", "new_zeros",
    "new_ones", "new_full", "new_tensor", "is_shared", "is_pinned", "_is_view",
    "untyped_storage")}  # a partitioned one has 0 bytes: true, and set_ on it fails cleanly
_META |= {torch.empty_like, torch.zeros_like, torch.ones_like, torch.full_like, torch.rand_like,
          torch.randn_like, torch.randint_like, torch._has_compatible_shallow_copy_type}
# Ops that write every element of their first argument without reading it.
_OVERWRITE = {getattr(_T, n) for n in ("uniform_", "normal_", "fill_", "zero_", "copy_", "random_",
                                       "exponential_", "geometric_", "cauchy_", "log_normal_")}
_OVERWRITE |= {_T.data.__set__}
_OVERWRITE |= {getattr(nn.init, n) for n in (
    "uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
    "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_",
    "sparse_") if hasattr(nn.init, n)}
_CONVERT = {_T.to, _T.cpu, _T.type, _T.float, _T.double, _T.half, _T.bfloat16}


def op_name(func) -> str:
    n = getattr(func, "__name__", None) or str(func)
    if n in ("__get__", "__set__"):  # a property: say which
        n = f"{getattr(getattr(func, '__self__', None), '__name__', '?')}.{n}"
    return n


def placeholder(shape, dtype, device) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype, device=device)
    t.untyped_storage().resize_(0)
    return t


def raw(p: torch.Tensor) -> torch.Tensor:
    """The tensor behind `p`, as a plain Tensor sharing its storage (no interception)."""
    with DisableTorchFunctionSubclass():
        return p.data


def _set_raw(p: torch.Tensor, t: torch.Tensor) -> None:
    with DisableTorchFunctionSubclass():
        p.data = t


class InitRecord:
    """`p._zero_init`: how Init holds one parameter. `piece` is None while it is full."""

    def __init__(self, p: nn.Parameter, comm, owner: nn.Module | None, attr: str):
        self.comm, self.rank, self.world = comm, comm.rank, comm.size
        self.owner = weakref.ref(owner) if owner is not None else None
        self.owner_cls = type(owner).__name__ if owner is not None else "?"
        self.attr = attr
        self.param = weakref.ref(p)
        self.piece: torch.Tensor | None = None
        self.pinned = 0  # open GatheredParameters blocks holding it full
        self.shape, self.dtype, self.numel, self.chunk = p.shape, p.dtype, p.numel(), 0

    @property
    def path(self) -> str:
        """Dotted name from the outermost module seen registering it (names are known
        only once the parents register their children, so computed on demand)."""
        parts, m = [self.attr], self.owner() if self.owner is not None else None
        while m is not None and m in PARENT:
            parent, name = PARENT[m]
            parts.append(name)
            m = parent()
        return ".".join(reversed(parts))

    @property
    def full(self) -> bool:
        return self.piece is None

    def describe(self) -> str:
        return f"parameter '{self.path}' ({self.owner_cls}.{self.attr}, shape {tuple(self.shape)})"

    def gather(self) -> torch.Tensor:
        """Full fp32 values (collective while partitioned: every rank of `comm` calls)."""
        p = self.param()
        if self.full:
            return raw(p).detach().float().clone()
        return self._gathered().float()

    def _gathered(self, timeout: float | None = None) -> torch.Tensor:
        buf = torch.empty(self.chunk * self.world, dtype=self.piece.dtype)
        h = self.comm.all_gather(self.piece, buf, async_op=True)
        try:
            h.wait(timeout=timeout)
        except Exception as e:
            raise RuntimeError(f"zerompi.Init: gathering {self.describe()} failed on rank "
                               f"{self.rank}: {e}. Code run under zerompi.Init must touch parameters "
                               "identically on every rank.") from e
        return buf[:self.numel].view(self.shape)


class ZeroInitParameter(nn.Parameter):
    """A parameter held by zerompi.Init; see the module docstring."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _META:
            with DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        every = _held(args, kwargs)
        held = list(dict.fromkeys(every))  # once each, in order (hash is id-based)
        session = ACTIVE[-1] if ACTIVE else None
        if session is not None:  # bringing one argument in must not push another out
            session.busy = {id(q) for q in held}
        for p in held:
            rec = p._zero_init
            if rec.full:
                if session is not None:
                    session.touch(p)
                continue
            if func is _T.__repr__:
                return f"ZeroInitParameter({rec.describe()}, partitioned over {rec.world} ranks)"
            if _is_noop(func, p, args, kwargs):
                return p
            if session is None:
                raise RuntimeError(
                    f"zerompi.Init: {rec.describe()} is partitioned over {rec.world} ranks and has "
                    f"no full values outside the `with zerompi.Init(...)` block, but `{op_name(func)}` "
                    "needs them. Do it inside the Init block, inside `with zerompi.GatheredParameters"
                    "([param]):` (every rank), or load weights with engine.load_full_state_dict().")
            # no gather when the op writes every element and reads no other copy of p
            overwrite = (func in _OVERWRITE and _target(args, kwargs) is p
                         and sum(x is p for x in every) == 1)
            session.bring(p, overwrite=overwrite, op=op_name(func))
        if session is None:
            with DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        logged = [q for q in held if not q._zero_init.pinned]  # GatheredParameters: rank-local
        if logged:
            session.log(logged, func)
        try:
            with DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        finally:
            session.busy = set()
            session.shrink()

    def __deepcopy__(self, memo):
        """A copy of a partitioned parameter stays partitioned (its piece is copied, no
        communication); a copy of a full one is tracked like a new registration."""
        if id(self) in memo:
            return memo[id(self)]
        rec = self._zero_init
        data = raw(self).clone() if rec.full else placeholder(rec.shape, rec.dtype, self.device)
        new = nn.Parameter(data, self.requires_grad)
        owner = rec.owner() if rec.owner is not None else None
        _link_copies(owner, memo)
        track(new, rec.comm, memo.get(id(owner), owner), rec.attr)
        if not rec.full:
            nrec = new._zero_init
            nrec.piece, nrec.chunk = rec.piece.clone(), rec.chunk
            nrec.shape, nrec.dtype, nrec.numel = rec.shape, rec.dtype, rec.numel
        elif ACTIVE:
            ACTIVE[-1].added(new)
        else:
            partition(new)
        memo[id(self)] = new
        return new

    def __delattr__(self, name):
        # Legacy stores take over with `del p._zero_init`: then p is a plain Parameter.
        super().__delattr__(name)
        if name == "_zero_init":
            self.__class__ = nn.Parameter


def _link_copies(m, memo) -> None:
    """Deep copies of modules fire no registration hooks: give the copies of `m` and its
    copied ancestors the same names as the originals."""
    while m is not None and m in PARENT and id(m) in memo:
        parent_ref, name = PARENT[m]
        parent = parent_ref()
        if parent is None or id(parent) not in memo:
            return
        PARENT.setdefault(memo[id(m)], (weakref.ref(memo[id(parent)]), name))
        m = parent


def _held(args, kwargs) -> list:
    out = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, ZeroInitParameter):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(x for x in a if isinstance(x, ZeroInitParameter))
    return out


def _target(args, kwargs):
    """The tensor an op writes: its first argument (nn.init passes it by keyword), or out=."""
    if "out" in kwargs:
        return kwargs["out"]
    return args[0] if args else kwargs.get("tensor", kwargs.get("input"))


def _is_noop(func, p, args, kwargs) -> bool:
    """`model.cpu()`/`.to(same dtype)` and `p.data = <its own placeholder>` (as
    Module._apply does after a no-op conversion) need no values."""
    if func == _T.data.__set__:
        v = args[1]
        return v is p or (isinstance(v, torch.Tensor) and v.untyped_storage().nbytes() == 0
                          and v.shape == p.shape)
    if func in _CONVERT and args[:1] == (p,):
        with DisableTorchFunctionSubclass():
            probe = func(torch.empty(0, dtype=p.dtype, device=p.device), *args[1:], **kwargs)
        return isinstance(probe, torch.Tensor) and probe.dtype == p.dtype and probe.device == p.device \
            and not kwargs.get("copy", False)
    return False


def track(p: nn.Parameter, comm, owner: nn.Module | None, attr: str) -> None:
    """Make `p` (full, a plain nn.Parameter) a ZeroInitParameter held over `comm`."""
    if type(p) is not nn.Parameter:
        raise TypeError(f"zerompi.Init: parameter '{attr}' of {type(owner).__name__} is a "
                        f"{type(p).__name__}; Init partitions plain torch.nn.Parameter only (build "
                        "this module outside Init, or materialise lazy modules first)")
    p.__class__ = ZeroInitParameter
    p._zero_init = InitRecord(p, comm, owner, attr)


def partition(p: ZeroInitParameter) -> None:
    """Full -> partitioned: keep this rank's 1/N piece (no communication)."""
    rec = p._zero_init
    full = raw(p).detach()
    rec.shape, rec.dtype, rec.numel = full.shape, full.dtype, full.numel()
    rec.chunk = max(1, -(-rec.numel // rec.world))
    piece = torch.zeros(rec.chunk, dtype=full.dtype, device=full.device)
    seg = full.reshape(-1)[rec.rank * rec.chunk:(rec.rank + 1) * rec.chunk]
    piece[:seg.numel()].copy_(seg)
    rec.piece = piece
    _set_raw(p, placeholder(rec.shape, rec.dtype, full.device))


def materialize(p: ZeroInitParameter, overwrite: bool = False, timeout: float | None = None) -> None:
    """Partitioned -> full: gather the pieces (collective), or only allocate when the
    next op overwrites every element."""
    rec = p._zero_init
    if overwrite:
        full = torch.empty(rec.shape, dtype=rec.dtype, device=p.device)
    else:
        full = rec._gathered(timeout).clone()
    rec.piece = None
    _set_raw(p, full)


def evictable(p: ZeroInitParameter) -> bool:
    """No live view shares the storage (2 = the parameter + the probe's own reference)."""
    count = getattr(torch._C, "_storage_Use_Count", None)  # private: absent -> no view check
    s = raw(p).untyped_storage()
    return count is None or count(s._cdata) <= 2
