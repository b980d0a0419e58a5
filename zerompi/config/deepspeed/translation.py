"""Read a DeepSpeed JSON config as DeepSpeed means it (docs/migrating-from-deepspeed.md).

`zerompi.initialize(model, "ds_config.json")` and `python -m zerompi.train
--deepspeed_config ds_config.json` take the file a DeepSpeed user already has. Every key
goes through the one table (keys.py): mapped, ignored (it does not change the
trained model; named in one notice) or refused when switched on (a ConfigError naming
the key as written). A key the table does not know is named (top level: DeepSpeed ignores
those too) or refused (inside a block DeepSpeed validates). Keys that change the trained
model (precision, optimizer, clipping, schedule, batch, loss scaling) take DeepSpeed's
default when the file leaves them out; "auto" (the Hugging Face style) keeps the run's
own setting. Tuning keys (stage, buckets, offload, stage-3 knobs) a file leaves out keep
the run's setting: they do not change the result.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from .optim import ELEMENTWISE, elementwise, only
from .keys import ALIASES, BLOCKS, DS_VERSION, IGNORE, MAP, TABLE, lookup, switched_on
from .values import AUTO, Values
from .zero import map_zero
from ..errors import ConfigError
from ..zero import ZeroConfig

ADAM = ("adam", "adamw")  # DeepSpeed lower-cases its own optimizer names
SCHEDULES = {"WarmupLR": ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type",
                          "last_batch_iteration"),
             "WarmupDecayLR": ("total_num_steps", "warmup_min_lr", "warmup_max_lr", "warmup_num_steps",
                               "warmup_type", "last_batch_iteration"),
             "WarmupCosineLR": ("total_num_steps", "warmup_min_ratio", "warmup_num_steps", "cos_min_ratio",
                                "warmup_type", "last_batch_iteration")}
_REFUSED_SCHEDULES = {"OneCycle": "cyclic lr and momentum are not in the trainer (zerompi.initialize runs "
                      "DeepSpeed's OneCycle)",
                      "LRRangeTest": "an lr range test is not a training schedule"}
# Top-level keys that mark a dict as a DeepSpeed config (none is a zerompi key; "fp16"
# and "optimizer" are both, so they mark only in DeepSpeed's shape).
_MARKERS = ("zero_optimization", "train_batch_size", "train_micro_batch_size_per_gpu", "bf16", "bfloat16",
            "steps_per_print", "zero_allow_untested_optimizer", "amp", "scheduler", "sequence_parallel_size")
_AC_MARKERS = ("partition_activations", "cpu_checkpointing", "contiguous_memory_optimization",
               "number_checkpoints", "synchronize_checkpoint_boundary", "profile")


class DeepSpeedConfigWarning(UserWarning):
    """DeepSpeed config keys zerompi ignores (one warning names all of them)."""


@dataclass
class Translation:
    zero: dict = field(default_factory=dict)     # ZeroConfig keys the file decides
    trainer: dict = field(default_factory=dict)  # TrainConfig keys the file decides (batch, schedule)
    ignored: list = field(default_factory=list)  # named in the one notice
    unknown: list = field(default_factory=list)  # top-level keys the table does not know
    auto: list = field(default_factory=list)     # "auto": the run's own setting
    notes: list = field(default_factory=list)    # how a value was derived
    batch: dict | None = None                    # the batch arithmetic, for the start-up line
    schedule: str = "none"                       # none | auto | WarmupLR | WarmupCosineLR
    optimizer: bool = False                      # the file has an optimizer block
    lr_key: str = ""                             # the file's key the lr came from
    lr_default: bool = False                     # ... which the file leaves out: DeepSpeed's default


class Run:
    """The run's own settings ("auto" keeps them), by TrainConfig-dotted key: --config
    plus the command line (`cli`: the keys the command line set). Without `value`:
    zerompi's ZeroConfig defaults (zerompi.initialize has nothing else)."""

    def __init__(self, value: Callable[[str], Any] | None = None, cli: set | None = None):
        self._value, self.cli = value, cli or set()

    def __call__(self, key: str):
        if self._value is not None:
            return self._value(key)
        v: Any = {"zero": dataclasses.asdict(ZeroConfig())}
        for part in key.split("."):
            v = v[part]
        return v


def looks_like_deepspeed(data: Any) -> bool:
    if not isinstance(data, Mapping) or "stage" in data or "precision" in data:
        return False  # zerompi's own top-level keys
    fp16, opt, ac = data.get("fp16"), data.get("optimizer"), data.get("activation_checkpointing")
    return (any(k in data for k in _MARKERS)
            or (isinstance(ac, Mapping) and any(k in ac for k in _AC_MARKERS))
            or (isinstance(fp16, Mapping) and "enabled" in fp16)
            or (isinstance(opt, Mapping) and ("type" in opt or "params" in opt)))


def _leaves(d: Mapping, prefix: str = ""):
    for k, v in d.items():
        key = f"{prefix}{k}"
        canon = ALIASES.get(key, key)
        if key == "zero_optimization" and isinstance(v, bool):  # DeepSpeed's oldest form: true = stage 1
            yield "zero_optimization.stage", int(v)
        elif isinstance(v, Mapping) and (key in BLOCKS or canon in BLOCKS):
            yield from _leaves(v, key + ".")
        else:
            yield key, v


def translate(ds: Mapping, world_size: "int | Callable[[], int]" = None, run: Run | None = None,
              trainer: bool = False) -> Translation:
    """The zerompi settings a DeepSpeed config means. world_size: the ranks (their
    data-parallel share is divided by the run's zero.tensor_parallel_size); run: the
    run's own settings; trainer: python -m zerompi.train (which has a schedule)."""
    run = run or Run()
    t = Translation()
    _check_types(ds, trainer)
    flat: dict = {}
    for key, value in _leaves(ds):
        entry = lookup(key)
        if key.startswith("bfloat16.") and "bf16" in ds:
            continue  # DeepSpeed reads bf16 then; bfloat16 is named below
        if entry is None:
            if "." not in key:
                t.unknown.append(key)
                continue
            block = key.rpartition(".")[0]
            raise ConfigError(key, value, f"not a key of DeepSpeed {DS_VERSION}'s {block} that zerompi knows; "
                              "DeepSpeed rejects unknown keys there too")
        flat[ALIASES.get(key, key)] = (key, value)
    if "bfloat16" in ds and "bf16" in ds:
        t.ignored.append("bfloat16 (bf16 is given: DeepSpeed reads that)")
    ctx = Values(flat)
    precision = _precision(ctx, t, run)
    for key, (name, value) in flat.items():
        entry = lookup(key)
        if not _in_effect(key, flat, precision):
            continue
        if value == AUTO:
            t.auto.append(name)
        elif entry.refuses(value):
            raise ConfigError(name, value, entry.what)
        elif entry.action == IGNORE and not entry.quiet and switched_on(value):
            t.ignored.append(name)
    ws = _world(world_size, run)
    _optimizer(ctx, t, run, trainer)
    _schedule(ctx, t, run, trainer)
    _clipping(ctx, t)
    _batch(ctx, t, ws, run)
    map_zero(ctx, t, precision, ws, run)  # stage, offload, buckets, dtypes, stage 3, checkpointing
    unread = [ctx.name(k) for k in flat if _in_effect(k, flat, precision) and lookup(k).action == MAP
              and ctx.given(k) and k not in ctx.read]
    assert not unread, f"mapped DeepSpeed keys the translator did not read: {unread}"
    return t


def _check_types(ds: Mapping, trainer: bool) -> None:
    """optimizer.type and scheduler.type first: their refusal says more than a parameter
    the other optimizer or schedule does not know."""
    opt = ds.get("optimizer")
    if isinstance(opt, Mapping) and opt and str(opt.get("type")).lower() not in ADAM + ELEMENTWISE:
        raise ConfigError("optimizer.type", opt.get("type"), "zerompi trains with AdamW (DeepSpeed's Adam and "
                          "AdamW map onto it), SGD and Adagrad; other optimizers (LAMB, Lion, OneBitAdam, ...: "
                          "whole-tensor statistics or compressed communication) are refused" if "type" in opt
                          else "missing: DeepSpeed then ignores optimizer.params; give the type (Adam, AdamW, SGD, "
                          "Adagrad) or remove the block")
    sch = ds.get("scheduler")
    known = SCHEDULES if trainer else (*SCHEDULES, "OneCycle")  # initialize: optim/ds_schedules.py
    if isinstance(sch, Mapping) and sch.get("type") not in known and not _all_auto(sch):
        why = _REFUSED_SCHEDULES.get(sch.get("type"), "not a DeepSpeed schedule zerompi maps (WarmupLR and "
                                     "WarmupCosineLR with warmup_type linear are)")
        raise ConfigError("scheduler.type", sch.get("type"), why)


def _all_auto(sch: Mapping) -> bool:
    params = sch.get("params") or {}
    return bool(params) and all(v == AUTO for v in params.values())


def _in_effect(key: str, flat: dict, precision: str) -> bool:
    """Whether DeepSpeed uses the key: settings of a precision block not in use, of an
    offload whose device is none, or of a switched-off feature do nothing there either."""
    block = key.rpartition(".")[0]
    if block in ("fp16", "bf16"):
        return key.endswith(".enabled") or block == precision
    if block in ("amp", "torch_autocast", "tensor_parallel"):
        return key in ("amp.enabled", "torch_autocast.enabled", "tensor_parallel.autotp_size")
    if block.startswith("zero_optimization.offload_"):
        return key.endswith(".device") or switched_on(flat.get(block + ".device", ("", "none"))[1])
    return True


def _world(world_size, run: Run):
    """A function giving the data-parallel ranks (asked only when a key needs them)."""
    memo: list = []

    def dp() -> tuple[int, int, int]:
        if not memo:
            ws = world_size() if callable(world_size) else world_size if world_size is not None else ranks()
            tp = int(run("zero.tensor_parallel_size"))
            if tp < 1 or ws % tp:
                raise ConfigError("zero.tensor_parallel_size", tp, f"must divide the number of ranks ({ws})")
            memo.append((ws // tp, ws, tp))
        return memo[0]
    return dp


def ranks() -> int:
    from ... import runtime

    return runtime.init().Get_size()


def _precision(ctx: Values, t: Translation, run: Run) -> str:
    flags = {p: ctx.raw(f"{p}.enabled") for p in ("bf16", "fp16")}
    for p, v in flags.items():
        if v != AUTO and not isinstance(v, bool):
            raise ConfigError(ctx.name(f"{p}.enabled"), v, 'expected true, false or "auto"')
    on = [p for p, v in flags.items() if v is True]
    if len(on) == 2:
        raise ConfigError(ctx.name("bf16.enabled"), True, "bf16 and fp16 are both enabled; DeepSpeed refuses "
                          "that too: choose one")
    from_run = not on and AUTO in flags.values()  # "auto": the framework decides, i.e. the run
    precision = on[0] if on else str(run("zero.precision")) if from_run else "fp32"
    if from_run and ctx.given(f"{precision}.enabled"):  # explicitly false
        raise ConfigError(ctx.name(f"{precision}.enabled"), False, f"this run's precision is {precision} "
                          f"(the other block says \"auto\"), but this block switches {precision} off")
    if not from_run:
        t.zero["precision"] = precision
    if precision == "fp16":  # DeepSpeed's scaler, its defaults included
        scale = {"factor": 2.0}
        for ours, k in (("initial_scale", "fp16.initial_scale_power"), ("window", "fp16.loss_scale_window"),
                        ("hysteresis", "fp16.hysteresis"), ("min_scale", "fp16.min_loss_scale")):
            if not ctx.auto(k):
                v = ctx.number(k, integer=ours != "min_scale", low=-1e9 if ours == "initial_scale" else 1e-300)
                scale[ours] = 2.0 ** v if ours == "initial_scale" else v
        t.zero["fp16"] = scale
    return precision


def _optimizer(ctx: Values, t: Translation, run: Run, trainer: bool) -> None:
    """DeepSpeed's Adam/AdamW with its defaults (FusedAdam's and CPUAdam's; torch.optim.AdamW's
    weight_decay 0.01 with torch_adam). No optimizer block: the client's (the run's)."""
    if not any(k.startswith("optimizer.") for k in ctx.flat):
        return
    t.optimizer = True
    kind = str(ctx.get("optimizer.type")).lower()
    if kind in ELEMENTWISE:
        if trainer:
            raise ConfigError(ctx.name("optimizer.type"), ctx.get("optimizer.type"), "python -m zerompi.train "
                              "trains with AdamW; SGD and Adagrad run through zerompi.initialize")
        t.zero["optimizer"] = elementwise(ctx, t, kind)
        return
    only(ctx, ("lr", "betas", "eps", "weight_decay", "adam_w_mode", "torch_adam"), f"DeepSpeed's {kind}")
    torch_adam = ctx.get("optimizer.params.torch_adam") is True
    # DeepSpeed's "AdamW" is always decoupled; its "Adam" unless adam_w_mode is false
    decoupled = ctx.get("optimizer.params.adam_w_mode") is not False or kind == "adamw"
    opt = {}
    if not ctx.auto("optimizer.params.lr"):
        opt["lr"] = ctx.number("optimizer.params.lr")
        t.lr_key = ctx.name("optimizer.params.lr")
        t.lr_default = not ctx.given("optimizer.params.lr")
    if not ctx.auto("optimizer.params.betas"):
        betas = ctx.get("optimizer.params.betas")
        if not (isinstance(betas, (list, tuple)) and len(betas) == 2 and all(
                isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1 for b in betas)):
            raise ConfigError(ctx.name("optimizer.params.betas"), betas, "expected two numbers in [0, 1)")
        opt["betas"] = [float(b) for b in betas]
    if not ctx.auto("optimizer.params.eps"):
        opt["eps"] = ctx.number("optimizer.params.eps", low=1e-300)
    if not ctx.auto("optimizer.params.weight_decay"):
        opt["weight_decay"] = ctx.number("optimizer.params.weight_decay", 0.01 if torch_adam and decoupled else 0.0)
    if not decoupled and opt.get("weight_decay", run("zero.optimizer.weight_decay")) > 0:
        raise ConfigError(ctx.name("optimizer.params.adam_w_mode"), False, 'Adam with L2 weight decay (in the '
                          'gradient) is not AdamW; zerompi has decoupled weight decay only')
    t.zero["optimizer"] = opt


def _clipping(ctx: Values, t: Translation) -> None:
    if ctx.auto("gradient_clipping"):
        return
    t.zero["gradient_clipping"] = ctx.number("gradient_clipping")
    if not ctx.given("gradient_clipping"):
        t.notes.append(f"gradient_clipping absent: DeepSpeed's default {TABLE['gradient_clipping'].default:g} "
                       "(since DeepSpeed 0.19.3; older versions did not clip: write 0 to match them)")


def _schedule(ctx: Values, t: Translation, run: Run, trainer: bool) -> None:
    """WarmupLR / WarmupDecayLR / WarmupCosineLR onto the trainer's deepspeed_* schedules
    (zerompi/trainer/schedule.py). "auto" parameters take the run's numbers, as the Hugging
    Face integration fills them in (warmup_min_lr 0, warmup_max_lr lr, warmup_num_steps,
    total_num_steps), and the block's type runs, as DeepSpeed builds it (with its default
    warmup_type log when absent). zerompi.initialize: the block is built there."""
    params = [k for k in ctx.flat if k.startswith("scheduler.params.")]
    if "scheduler.type" not in ctx.flat and not params:
        return
    kind = ctx.get("scheduler.type", None)
    if params and all(ctx.auto(k) for k in params) and not (trainer and kind in SCHEDULES):
        t.schedule = "auto"
        ctx.read.update(params)
        return
    if not trainer:  # zerompi.initialize builds it from the block (zero/client_optim.py, ds_schedules.py)
        from .schedules import PARAMS
        for k in params:
            if k.rpartition(".")[2] not in PARAMS[kind]:
                raise ConfigError(ctx.name(k), ctx.flat[k][1], f"not a parameter of DeepSpeed's {kind}")
        ctx.read.update(params)
        ctx.read.add("scheduler.type")
        t.schedule = kind
        return
    for k in params:
        if k.rpartition(".")[2] not in SCHEDULES[kind]:
            raise ConfigError(ctx.name(k), ctx.flat[k][1], f"not a parameter of DeepSpeed's {kind}")
    wt = ctx.get("scheduler.params.warmup_type")
    if wt not in ("linear", "log", AUTO):  # auto: the trainer's own warm-up, which is linear
        raise ConfigError(ctx.name("scheduler.params.warmup_type"), wt, "linear or log (DeepSpeed's default)")
    if ctx.number("scheduler.params.last_batch_iteration", low=-1, integer=True) != -1:
        raise ConfigError(ctx.name("scheduler.params.last_batch_iteration"), ctx.flat[
            "scheduler.params.last_batch_iteration"][1], "only -1 (start at the beginning) is supported")
    t.schedule = kind
    tr = t.trainer
    tr["warmup_type"] = "linear" if wt == AUTO else wt
    w = run("warmup_steps") if ctx.auto("scheduler.params.warmup_num_steps") else \
        ctx.number("scheduler.params.warmup_num_steps", integer=True, low=1)
    tr["warmup_steps"] = max(2, int(w))  # DeepSpeed warms up over at least 2 steps
    opt_lr = t.zero.get("optimizer", {}).get("lr")
    peak = run("zero.optimizer.lr") if opt_lr is None or "zero.optimizer.lr" in run.cli else opt_lr
    if kind in ("WarmupLR", "WarmupDecayLR"):
        tr["lr_schedule"] = "deepspeed_warmup" if kind == "WarmupLR" else "deepspeed_warmup_decay"
        tr["warmup_start_lr"] = 0.0 if ctx.auto("scheduler.params.warmup_min_lr") else \
            ctx.number("scheduler.params.warmup_min_lr")
        # the peak; absent: WarmupLR the optimizer's lr, WarmupDecayLR DeepSpeed's 0.001; auto: the run's
        if ctx.given("scheduler.params.warmup_max_lr") or (kind == "WarmupDecayLR" and not ctx.auto(
                "scheduler.params.warmup_max_lr")):
            t.zero.setdefault("optimizer", {})["lr"] = ctx.number("scheduler.params.warmup_max_lr", 0.001)
            t.lr_key = ctx.name("scheduler.params.warmup_max_lr")
        if kind == "WarmupLR":
            return
        _total_steps(ctx, tr, kind)
        return
    tr["lr_schedule"] = "deepspeed_warmup_cosine"
    _total_steps(ctx, tr, kind)
    ratio = 0.0 if ctx.auto("scheduler.params.warmup_min_ratio") else ctx.number("scheduler.params.warmup_min_ratio")
    tr["warmup_start_lr"] = ratio * peak
    if not ctx.auto("scheduler.params.cos_min_ratio"):
        low = ctx.number("scheduler.params.cos_min_ratio")
        if low > 1:
            raise ConfigError(ctx.name("scheduler.params.cos_min_ratio"), low, "must be <= 1 (a floor above the "
                              "peak is not a decay)")
        tr["min_lr"] = low * peak


def _total_steps(ctx: Values, tr: dict, kind: str) -> None:
    if "scheduler.params.total_num_steps" not in ctx.flat:
        raise ConfigError("scheduler.params.total_num_steps", None, f"{kind} needs it (DeepSpeed too)")
    if not ctx.auto("scheduler.params.total_num_steps"):  # auto: the run's lr_decay_steps / max_steps
        tr["lr_decay_steps"] = max(1, ctx.number("scheduler.params.total_num_steps", integer=True))


def _batch(ctx: Values, t: Translation, dp, run: Run) -> None:
    """DeepSpeed's batch arithmetic over the data-parallel ranks: train_batch_size =
    micro x accumulation x dp, any one derived from the other two; an "auto"
    accumulation is the run's own."""
    names = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    tb, mb, ga = (ctx.number(k, integer=True, low=1) if ctx.given(k) else None for k in names)
    if ga is None and ctx.auto("gradient_accumulation_steps") and (tb or mb):
        ga = int(run("zero.gradient_accumulation_steps"))
    if tb is None and mb is None:
        if ga is not None:
            t.zero["gradient_accumulation_steps"] = ga
        return
    n, ws, tp = dp()
    derived = [k for k, v in zip(names, (tb, mb, ga)) if v is None]
    if mb is None:
        mb = tb // n // (ga or 1)
    if ga is None:
        ga = tb // (mb * n) if tb is not None and mb > 0 else 1
    if tb is None:
        tb = mb * ga * n
    over = f"{n} data-parallel ranks" + (f" ({ws} ranks / zero.tensor_parallel_size {tp})" if tp > 1 else "")
    if min(mb, ga) < 1 or tb != mb * ga * n:
        d = lambda k: " (derived)" if k in derived else ""  # noqa: E731
        raise ConfigError(ctx.name("train_batch_size"), tb, f"!= train_micro_batch_size_per_gpu {mb}{d(names[1])} "
                          f"x gradient_accumulation_steps {ga}{d(names[2])} x {over}; DeepSpeed requires equality")
    t.zero["gradient_accumulation_steps"] = ga
    t.trainer["global_batch"] = tb
    t.batch = {"global": tb, "micro": mb, "accum": ga, "dp": n, "world": ws, "tp": tp}


__all__ = ["AUTO", "DeepSpeedConfigWarning", "Run", "Translation", "looks_like_deepspeed", "translate"]
