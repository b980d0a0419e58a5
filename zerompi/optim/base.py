"""The torch.optim.Optimizer face every shard optimizer has (ShardedAdamW, the fused and
host AdamWs, SGD and Adagrad in elementwise.py), and the bookkeeping they share.

What torch code sees (docs/migrating-from-deepspeed.md, "The optimizer"):
  param_groups   torch-style groups over the model's parameters; the update reads each
                 group's hyper-parameters (lr, betas/momentum, ...) at every step, so any
                 torch.optim.lr_scheduler may write them between steps
  step()         the engine's: called by engine.step() at the accumulation boundary, after
                 the reduction, unscaling and clipping; a user's own call is refused
  zero_grad()    nothing to do: the engine clears its gradient buffers after each update
  state_dict()   torch's structure: param_groups (hyper-parameters, indices for params) and
                 per-parameter "step"; moments and fp32 master weights are partitioned over
                 ranks and live in the engine's checkpoint (engine.save_checkpoint), as a
                 DeepSpeed ZeRO optimizer's do. load_state_dict restores the same and
                 refuses moment tensors rather than dropping them.

Internally a step addresses its groups by segment (Segment.group indexes `self.groups`,
every group the engine built); `param_groups` holds the same dict objects, minus the
default group when it has no parameters (a user's groups that cover the whole model),
so a scheduler given one lambda per user group lines up with the user's groups.
"""
from __future__ import annotations

from typing import Sequence

import torch

_STATE_NOTE = ("moments and fp32 master weights are partitioned over ranks: save and load them with "
               "engine.save_checkpoint / engine.load_checkpoint")


class ShardOptimizer(torch.optim.Optimizer):
    """Bookkeeping of an optimizer over a segment table: `views(shard_lo, flat_lo, n)`
    gives (master, grad, state_a, state_b, lowp or None) of a segment (ShardState.views);
    per-parameter step counts; groups as above. Subclasses implement step()."""

    KIND = "adamw"
    HYPER = ("lr", "betas", "eps", "weight_decay")  # the group keys the update reads

    def __init__(self, segments, views, param_groups: list[dict], num_params: int):
        self.segments = list(segments)
        # Host memory never moves, so the views are made once, not every step.
        self._views = [views(s.shard_lo, s.flat_lo, s.length) for s in self.segments]
        self.groups = param_groups
        self.steps = [0] * num_params
        # torch's own set-up (hooks, step profiling), then our groups in place of its one.
        # Its __init__ and add_param_group are wrapped in torch._disable_dynamo, whose first
        # call imports torch._dynamo: seconds of CPU on every rank of every job. The body
        # runs unwrapped, adding its one placeholder group plainly.
        base_init = getattr(torch.optim.Optimizer.__init__, "__wrapped__", torch.optim.Optimizer.__init__)
        self.add_param_group = self.param_groups_append  # shadows the wrapped method during set-up
        base_init(self, [torch.zeros(0, requires_grad=True)], {k: v for k, v in param_groups[0].items()
                                                               if k != "params"})
        del self.add_param_group
        for g in param_groups:
            g.setdefault("params", [])
        self.param_groups = list(param_groups)
        self._index_of: dict[int, int] = {}  # id(model parameter) -> index of its step count

    def param_groups_append(self, group: dict) -> None:
        self.param_groups.append(group)

    def attach_params(self, params: Sequence[torch.Tensor], group_of: Sequence[int], hide_empty_default: bool) -> None:
        """Fill each group's "params" with the model's parameters (engine order); drop the
        default group 0 from param_groups when it has none and the user gave groups."""
        for g in self.groups:
            g["params"] = []
        for p, gi in zip(params, group_of):
            self.groups[gi]["params"].append(p)
        self._index_of = {id(p): i for i, p in enumerate(params)}
        keep = [g for i, g in enumerate(self.groups) if i > 0 or g["params"] or not hide_empty_default]
        self.param_groups = keep or self.groups[:1]

    # ------------------------------------------------------------ engine calls
    @staticmethod
    def _engine_call(grad_coef, device_coef=None) -> float:
        """The engine passes the step's coefficient; torch code calling optimizer.step()
        (or step(closure)) would apply an unreduced, unscaled, unclipped gradient."""
        if (grad_coef is None and device_coef is None) or callable(grad_coef):
            raise RuntimeError("the zerompi optimizer is stepped by engine.step() (after engine.backward(loss)), "
                               "which reduces, unscales and clips the gradients first; call engine.step() "
                               "instead of optimizer.step()")
        return 1.0 if grad_coef is None else grad_coef

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: the engine zeroes its gradient buffers after every update (and
        between micro-steps the gradients must accumulate)."""

    def _count_steps(self, used: Sequence[bool] | None) -> None:
        """Advance the step count of every parameter that got a gradient (every subclass's
        step starts here: the counts drive bias correction and are checkpointed)."""
        self._opt_called = True  # what torch's schedulers look for ("step() before optimizer.step()")
        for i in range(len(self.steps)):
            if used is None or used[i]:
                self.steps[i] += 1

    def uncount_steps(self, used: Sequence[bool] | None) -> None:
        """Take back _count_steps: an update issued on the device that skipped itself
        (a non-finite gradient, zero/step_coef.py) did not happen."""
        for i in range(len(self.steps)):
            if used is None or used[i]:
                self.steps[i] -= 1

    @property
    def views(self) -> list:
        """Per segment: (master, stored gradient, state_a, state_b, low-precision copy)."""
        return self._views

    def grad_sq_norm(self, weights: Sequence[float] | None = None) -> torch.Tensor:
        """Squared L2 norm of the stored gradients of this rank's segments, as a 0-d
        float64 tensor on their device (no host wait here: the engine reads it once);
        `weights` (per segment) scales each one's share (tp replicas count 1/tp).
        Summed in segment order, in float64, as Python floats would be."""
        total = None
        for k, (_, g, _, _, _) in enumerate(self._views):
            sq = torch.linalg.vector_norm(g, dtype=torch.float64) ** 2
            if weights is not None:
                sq = sq * weights[k]
            total = sq if total is None else total + sq
        if total is None:
            dev = self._views[0][1].device if self._views else torch.device("cpu")
            total = torch.zeros((), dtype=torch.float64, device=dev)
        return total

    # ------------------------------------------------------------ checkpoint (engine)
    def hyper_state(self) -> dict:
        """Step counts and every group's JSON-able keys (a scheduler's initial_lr too): what
        the engine's checkpoint stores beside the tensors."""
        return {"steps": list(self.steps), "param_groups": [_jsonable(g) for g in self.groups]}

    def load_hyper_state(self, state: dict) -> None:
        for i, s in enumerate(state["param_groups"]):
            missing = [k for k in self.HYPER if k not in s]
            if missing:
                raise ValueError(f"the checkpoint's parameter group {i} has no {missing}: it was saved by another "
                                 f"optimizer than this engine's {self.KIND} (zero.optimizer.type), whose states "
                                 "are not these")
        self.steps = [int(s) for s in state["steps"]]
        for g, s in zip(self.groups, state["param_groups"]):
            g.update({k: (tuple(v) if k == "betas" else v) for k, v in s.items() if k != "params"})

    # ------------------------------------------------------------ torch's face
    def state_dict(self) -> dict:
        """torch's structure (see the module docstring): hyper-parameters and step counts;
        moments and master weights are in engine checkpoints."""
        flat = [p for g in self.param_groups for p in g["params"]]
        index = {id(p): i for i, p in enumerate(flat)}
        groups = [dict(_jsonable(g), params=[index[id(p)] for p in g["params"]]) for g in self.param_groups]
        state = {i: {"step": torch.tensor(float(self.steps[self._index_of[id(p)]]))}
                 for i, p in enumerate(flat) if id(p) in self._index_of}
        return {"state": state, "param_groups": groups, "zerompi": _STATE_NOTE}

    def load_state_dict(self, state_dict: dict) -> None:
        """Hyper-parameters (and a scheduler's keys) and step counts of state_dict();
        moment tensors are refused: they load through engine.load_checkpoint."""
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(f"load_state_dict: {len(groups)} parameter groups for an optimizer with "
                             f"{len(self.param_groups)}")
        for i, st in state_dict.get("state", {}).items():
            extra = sorted(set(st) - {"step"})
            if extra:
                raise ValueError(f"load_state_dict: state[{i}] holds {extra}; {_STATE_NOTE}")
        flat = [p for g in self.param_groups for p in g["params"]]
        for i, st in state_dict.get("state", {}).items():
            k = self._index_of.get(id(flat[int(i)]))
            if k is not None:
                self.steps[k] = int(float(st["step"]))
        for g, s in zip(self.param_groups, groups):
            g.update({k: (tuple(v) if k == "betas" else v) for k, v in s.items() if k != "params"})


def _jsonable(g: dict) -> dict:
    """A group's keys a checkpoint's JSON holds: numbers, strings, and tuples/lists of them."""
    out = {}
    for k, v in g.items():
        if k == "params":
            continue
        if isinstance(v, tuple):
            v = list(v)
        if isinstance(v, torch.Tensor) and v.numel() == 1:
            v = v.item()
        out[k] = v
    return out
