"""What a DeepSpeed config turned into, said once on rank 0 at start: the keys ignored
(one warning), the "auto" keys that kept the run's settings, the effective optimizer,
schedule, precision, clipping and batch arithmetic (to compare with what DeepSpeed
prints), and how values were derived. The trainer adds the rule of which side wins."""
from __future__ import annotations

import math
import warnings

from .translation import DeepSpeedConfigWarning, Translation
from ...runtime.console import say, world_rank

RULE = ("the DeepSpeed file decides precision, optimizer, clipping, batch and schedule, with DeepSpeed's defaults "
        "for what it leaves out; \"auto\", and an optimizer or scheduler block it does not have, keep --config's "
        "(or zerompi's) settings; --config gives everything else; --key value on the command line beats both")


def rank0() -> bool:
    return world_rank() == 0


def notice(t: Translation, source: str) -> str:
    """The one warning: keys ignored, and top-level keys the table does not know."""
    parts = []
    if t.ignored:
        parts.append(f"zerompi ignores {len(t.ignored)} key(s) that do not change the trained model: "
                     + ", ".join(t.ignored))
    if t.unknown:
        parts.append(f"{len(t.unknown)} key(s) unknown to zerompi, not used (DeepSpeed ignores unknown top-level "
                     "keys too): " + ", ".join(t.unknown))
    return f"{source}: {'; '.join(parts)} (docs/migrating-from-deepspeed.md)" if parts else ""


def _dtype(zero, which: str) -> str:
    return "fp32" if getattr(zero, which) == "fp32" or zero.precision == "fp32" else zero.precision


def _schedule(t: Translation, train) -> str:
    if train is None:
        if t.schedule not in ("auto", "none"):
            return f"DeepSpeed's {t.schedule} as engine.lr_scheduler, stepped after each applied update"
        return ("your loop's (\"auto\")" if t.schedule == "auto" else "none") + ": pass lr_scheduler= to " \
            "zerompi.initialize, or set engine.param_groups' lr in your loop"
    lr, w, a, low = train.zero.optimizer.lr, train.warmup_steps, train.warmup_start_lr, train.min_lr
    end = train.lr_decay_steps or train.max_steps
    shape = train.warmup_type
    if train.lr_schedule == "deepspeed_warmup":
        return (f"WarmupLR, {shape} warm-up, by applied updates: {a:g} at updates 0 and 1, to {lr:g} at update "
                f"{w + 1}, then constant")
    if train.lr_schedule == "deepspeed_warmup_decay":
        return (f"WarmupDecayLR, {shape} warm-up, by applied updates: {a:g} at updates 0 and 1, to {lr:g} at "
                f"update {w + 1}, then linear decay to {a:g} at update {end + 1}")
    if train.lr_schedule == "deepspeed_warmup_cosine":
        return (f"WarmupCosineLR, {shape} warm-up, by applied updates: 0 at update 0, from {a:g} at update 1 towards "
                f"{lr:g} over {w} updates, then cosine to {low:g} at update {end}")
    why = {"auto": "the scheduler's parameters are all \"auto\"", "none": "the file has no scheduler"}[t.schedule]
    return (f"the trainer's own ({why}): linear warm-up to {lr:g} over {w} steps, cosine to {low:g} at step {end}")


def effective(t: Translation, zero, train=None, dp: int | None = None) -> str:
    """One line: the optimizer, schedule, precision, clipping and batch in effect."""
    o = zero.optimizer
    opt = (f"optimizer AdamW lr {o.lr:g}, betas ({o.betas[0]:g}, {o.betas[1]:g}), eps {o.eps:g}, weight_decay "
           f"{o.weight_decay:g}" + (" (biases and norms 0: the trainer's groups)" if train else "")
           + ", bias-corrected, decoupled" + ("" if t.optimizer else " (the run's: the file has no optimizer)"))
    if o.type == "sgd":
        opt = (f"optimizer SGD lr {o.lr:g}, momentum {o.momentum:g}, dampening {o.dampening:g}, nesterov "
               f"{o.nesterov}, weight_decay {o.weight_decay:g} (torch.optim.SGD's update)")
    elif o.type == "adagrad":
        opt = (f"optimizer Adagrad lr {o.lr:g}, lr_decay {o.lr_decay:g}, initial_accumulator_value "
               f"{o.initial_accumulator_value:g}, eps {o.eps:g}, weight_decay {o.weight_decay:g} "
               "(torch.optim.Adagrad's update)")
    prec = (f"precision {zero.precision} (gradients reduced in {_dtype(zero, 'reduce_dtype')}, accumulated in "
            f"{_dtype(zero, 'grad_accum_dtype')}")
    if zero.precision == "fp16":
        s = zero.fp16
        prec += (f"; dynamic loss scale from 2^{math.log2(s.initial_scale):g}, window {s.window}, hysteresis "
                 f"{s.hysteresis}, min {s.min_scale:g}")
    clip = f"clipping at global L2 norm {zero.gradient_clipping:g}" if zero.gradient_clipping else "no clipping"
    ga = zero.gradient_accumulation_steps
    if train is not None and dp:
        tb = train.global_batch
        micro = f"{tb // (ga * dp)}" if tb % (ga * dp) == 0 else f"{tb / (ga * dp):g} (uneven rows)"
        tp = train.zero.tensor_parallel_size
        ranks = f"{dp} data-parallel ranks" + (f" ({dp * tp} / tensor_parallel_size {tp})" if tp > 1 else "")
        batch = f"batch {tb} = micro {micro} x accumulation {ga} x {ranks}"
    elif t.batch:
        b = t.batch
        batch = f"batch {b['global']} = micro {b['micro']} x accumulation {ga} x {b['dp']} data-parallel ranks"
    else:
        batch = f"accumulation {ga} micro-batches per update"
    return "; ".join((opt, "schedule " + _schedule(t, train), prec + ")", clip, batch))


def announce(t: Translation, source: str, lines: list[str], prefix: str) -> None:
    """Rank 0: the notice (a Python warning from zerompi.initialize, a stderr line from a
    command line), then the info lines on stdout (trainer) or stderr (library)."""
    if not rank0():
        return
    msg = notice(t, source)
    if msg and prefix == "zerompi":
        warnings.warn(msg, DeepSpeedConfigWarning, stacklevel=4)
    elif msg:
        say(f"warning: {msg}", rank=0, prog=prefix)
    if t.auto:
        lines = [f"{source}: \"auto\" keeps this run's own setting for {len(t.auto)} key(s): "
                 + ", ".join(t.auto)] + lines
    if t.notes:
        lines = lines + [f"{source}: " + "; ".join(t.notes)]
    for line in lines:
        say(line, rank=0, prog=prefix, err=prefix == "zerompi")
