"""The Hugging Face Trainer on zerompi: `ZeroTrainer`, and a launcher for unmodified scripts.

An unmodified run_clm.py-style script (HfArgumentParser, `from transformers import
Trainer`), launched the zerompi way: the one change is the launcher,

    torchrun --nproc_per_node 4 run_clm.py ... --deepspeed ds_zero3.json
    mpiexec -n 4 python -m zerompi.integrations.transformers run_clm.py ... --deepspeed ds_zero3.json

The launcher agrees a torch.distributed group over MPI (zerompi.init_process_group, so
accelerate and TrainingArguments see N processes, rank 0 saves, the data loader is
sharded), takes `--deepspeed FILE` off the command line as the zerompi config (a DeepSpeed
JSON or zerompi config; HF then never looks for DeepSpeed), puts ZeroTrainer in place of
transformers.Trainer, and runs the script as __main__. In your own script instead:

    import zerompi
    from zerompi.integrations.transformers import ZeroTrainer
    zerompi.init_process_group()        # before TrainingArguments: accelerate reads the group
    trainer = ZeroTrainer(model=model, args=training_args, ..., zero_config={"stage": 3})

What goes through the engine (the hook points, each a Trainer method overridden here):
  create_optimizer   builds the engine (zerompi.initialize) from zero_config, with the
                     TrainingArguments deciding what HF decides: gradient_accumulation_steps,
                     max_grad_norm (clipping), bf16/fp16, learning_rate, adam_beta1/2,
                     adam_epsilon, weight_decay (the Trainer's decay / no-decay groups), seed.
                     The Trainer's optimizer is a view of the engine optimizer's param_groups
                     (so HF's scheduler, any lr_scheduler_type, writes the lr the engine uses);
                     its step() and zero_grad() do nothing: the engine updates.
  _wrap_model        the model the Trainer calls (training and evaluation) is the engine;
                     never DDP.
  training_step      engine.backward(loss) and engine.step() per micro-batch; the update
                     happens at the Trainer's accumulation boundary (checked).
  _clip_grad_norm    the engine clips (zero gradient_clipping = max_grad_norm); the logged
                     grad_norm is the engine's global pre-clip norm.
  save_model         engine.full_state_dict() (collective) -> save_pretrained on rank 0.
  _save_optimizer_and_scheduler / _load_optimizer_and_scheduler / _load_from_checkpoint:
                     checkpoint-N/zerompi/ is an engine checkpoint (weights, moments, step
                     counts); scheduler.pt, trainer_state.json and the RNG states are HF's own.
Loss: the Trainer's own (token-count normalised through num_items_in_batch where the model
takes it, average_tokens_across_devices as set), so the gradient is the one DDP would have.
Not supported (refused by name): optimizers other than AdamW (args.optim), optimizers=
passed to the Trainer, tensor parallelism, load_best_model_at_end, a Trainer-level
DeepSpeed or FSDP config. The epoch's micro-batches per rank must be a multiple of
gradient_accumulation_steps (the engine cannot end an accumulation early).
"""
from __future__ import annotations

import os
import runpy
import sys
from collections import OrderedDict, defaultdict

import torch
import torch.nn as nn
from transformers import Trainer

ZERO_DIR = "zerompi"  # the engine checkpoint inside checkpoint-N/
SCHEDULER_NAME = "scheduler.pt"
DEFAULT_CONFIG = None  # the launcher's --deepspeed file: ZeroTrainer's zero_config when none is given
ADAMW = ("adamw_torch", "adamw_torch_fused", "adamw_hf", "adamw")


class EngineOptimizer(torch.optim.Optimizer):
    """What the Trainer and accelerate hold as the optimizer: the engine optimizer's
    param_groups (a scheduler writes their lr, the engine reads it at its next update);
    step() and zero_grad() do nothing, since engine.step() in training_step updates; its
    state lives in the engine checkpoint (state_dict() is a marker, load_state_dict()
    ignores it)."""

    def __init__(self, engine):  # no Optimizer.__init__: the groups are the engine's, shared
        self.engine = engine
        self.defaults = dict(getattr(engine.optimizer, "defaults", {}))
        self.param_groups = engine.optimizer.param_groups
        self.state = defaultdict(dict)
        for name in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks", "_optimizer_state_dict_pre_hooks",
                     "_optimizer_state_dict_post_hooks", "_optimizer_load_state_dict_pre_hooks",
                     "_optimizer_load_state_dict_post_hooks"):
            setattr(self, name, OrderedDict())

    def step(self, closure=None):
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass

    def state_dict(self) -> dict:
        return {"zerompi": f"the optimizer state is in the engine checkpoint ({ZERO_DIR}/)"}

    def load_state_dict(self, state_dict: dict) -> None:
        pass


class EngineModule(nn.Module):
    """The engine as the nn.Module the Trainer calls: forward is engine(...); the HF model
    is `.module` (transformers' unwrap_model finds it); zero_grad does nothing."""

    def __init__(self, engine):
        super().__init__()
        self.engine = engine
        self.module = engine.module

    def forward(self, *args, **kwargs):
        return self.engine(*args, **kwargs)

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass


class ZeroTrainer(Trainer):
    """transformers.Trainer whose model, optimizer step, clipping, save and resume are a
    zerompi engine's (module docstring). `zero_config`: a zerompi or DeepSpeed config
    (dict, path or ZeroConfig); TrainingArguments override the keys the Trainer owns."""

    def __init__(self, *args, zero_config=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.zero_config = DEFAULT_CONFIG if zero_config is None else zero_config
        self.engine = None
        self._engine_module = None
        a = self.args
        if self.optimizer is not None:
            raise ValueError("ZeroTrainer: optimizers=(optimizer, ...) is not supported: the zerompi engine builds "
                             "its AdamW from TrainingArguments (learning_rate, adam_beta1/2, adam_epsilon, "
                             "weight_decay); pass a scheduler through lr_scheduler_type")
        if str(getattr(a.optim, "value", a.optim)) not in ADAMW:
            raise ValueError(f"ZeroTrainer: TrainingArguments.optim={a.optim!r} is not supported; zerompi trains "
                             f"with AdamW ({', '.join(ADAMW)})")
        if a.load_best_model_at_end:
            raise ValueError("ZeroTrainer: load_best_model_at_end is not supported (the best checkpoint's weights "
                             "would have to be loaded into the engine)")
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            raise ValueError("ZeroTrainer: TrainingArguments.deepspeed / fsdp are set; zerompi is the ZeRO here: "
                             "give the config as ZeroTrainer(zero_config=...)")
        self._check_world()
        if a.data_seed is None:
            # the sampler's order from args.seed on every rank (the engine re-seeds torch per rank)
            a.data_seed = a.seed

    def _check_world(self) -> None:
        from .. import runtime

        n = runtime.init().Get_size()
        if self.args.world_size != n:
            raise RuntimeError(f"ZeroTrainer: TrainingArguments see {self.args.world_size} process(es) but MPI has "
                               f"{n}: call zerompi.init_process_group() before creating TrainingArguments, or launch "
                               "with python -m zerompi.integrations.transformers")

    # ------------------------------------------------------------------ the engine
    def _build_engine(self):
        if self.engine is not None:
            return self.engine
        import zerompi
        from ..config import load as load_config, to_dict

        a = self.args
        owned = {"gradient_accumulation_steps": a.gradient_accumulation_steps, "seed": a.seed,
                 "gradient_clipping": float(a.max_grad_norm or 0.0),
                 "precision": "bf16" if a.bf16 else "fp16" if a.fp16 else "fp32", "optimizer.lr": a.learning_rate,
                 "optimizer.betas": [a.adam_beta1, a.adam_beta2], "optimizer.eps": a.adam_epsilon,
                 "optimizer.weight_decay": a.weight_decay}  # what the Trainer decides, over the file
        cfg = to_dict(load_config(self.zero_config, owned, dp_size=a.world_size))
        if cfg.get("tensor_parallel_size", 1) != 1:
            raise ValueError("ZeroTrainer: tensor_parallel_size must be 1 (accelerate shards the data over every rank)")
        decay = set(self.get_decay_parameter_names(self.model))
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        groups = [{"params": [p for n, p in named if n in decay], "weight_decay": a.weight_decay},
                  {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]
        self.engine = zerompi.initialize(self.model, cfg, param_groups=[g for g in groups if g["params"]])
        return self.engine

    def create_optimizer(self, model=None):
        if self.optimizer is None:
            self.optimizer = EngineOptimizer(self._build_engine())
        return self.optimizer

    def _wrap_model(self, model, training: bool = True, dataloader=None):
        if self._engine_module is None:
            self._engine_module = EngineModule(self._build_engine())
        return self._engine_module

    def set_initial_training_values(self, args, dataloader, *rest, **kw):
        values = super().set_initial_training_values(args, dataloader, *rest, **kw)
        steps_in_epoch, gas = values[5], args.gradient_accumulation_steps
        if steps_in_epoch % gas:
            raise ValueError(f"ZeroTrainer: an epoch has {steps_in_epoch} micro-batches per rank, not a multiple of "
                             f"gradient_accumulation_steps={gas}; the engine cannot end an accumulation early: "
                             "change the batch size, accumulation or dataset size (dataloader_drop_last)")
        return values

    def training_step(self, model, inputs, num_items_in_batch=None):
        engine = self.engine
        model.train()
        inputs = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        scaled = self.loss_is_scaled_for_ga  # the Trainer's rule: normalised by the batch's token count?
        if scaled is None:
            scaled = (self.model_accepts_loss_kwargs and num_items_in_batch is not None) \
                or self.compute_loss_func is not None
        if self.accelerator.gradient_state.sync_gradients != engine.is_gradient_accumulation_boundary():
            raise RuntimeError(f"ZeroTrainer: the Trainer's accumulation boundary and the engine's disagree at "
                               f"micro-step {engine.micro_steps} (gradient_accumulation_steps="
                               f"{engine.gradient_accumulation_steps})")
        # The engine's gradient is the mean of the micro-batch losses over accumulation and
        # ranks (1 / (GAS x N)); DDP's is their sum over accumulation and mean over ranks.
        # A loss the Trainer normalised by the token count is for the latter: times GAS.
        gas = self.current_gradient_accumulation_steps
        engine.backward(loss * gas if scaled else loss)
        engine.step()
        return loss.detach() if scaled else loss.detach() / gas  # what the Trainer logs, as it would

    def _clip_grad_norm(self, model):
        return self.engine.last_grad_norm  # clipped in engine.step() (gradient_clipping = max_grad_norm)

    def _get_grad_norm(self, model, grad_norm=None):
        return self.engine.last_grad_norm if grad_norm is None else grad_norm

    # ------------------------------------------------------------------ save and resume
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Collective: every rank calls it (the Trainer and run_clm.py do); rank 0 writes
        save_pretrained's files with the engine's fp32 weights."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        state = self._build_engine().full_state_dict()
        if self.args.should_save:
            params = {n for n, _ in self.model.named_parameters(remove_duplicate=False)}
            state.update({k: v for k, v in self.model.state_dict().items() if k not in params and k not in state})
            self._save(output_dir, state_dict=state)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        self.engine.save_checkpoint(os.path.join(output_dir, ZERO_DIR))  # collective
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _zero_dir(self, checkpoint: str) -> str:
        path = os.path.join(checkpoint, ZERO_DIR)
        if not os.path.isdir(path):
            raise FileNotFoundError(f"ZeroTrainer: {checkpoint} has no {ZERO_DIR}/ engine checkpoint (it was not "
                                    "saved by ZeroTrainer); resume from a checkpoint ZeroTrainer saved")
        return path

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        self._zero_dir(resume_from_checkpoint)  # the weights come with the engine's state, below

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        self.engine.load_checkpoint(self._zero_dir(checkpoint))  # collective
        sched = os.path.join(checkpoint, SCHEDULER_NAME)
        if os.path.isfile(sched):
            self.lr_scheduler.load_state_dict(torch.load(sched, weights_only=True))


def _take_config(argv: list[str]) -> tuple[object, list[str]]:
    """--deepspeed FILE (or --deepspeed=FILE) off the script's arguments: the zerompi config."""
    rest, config, i = [], None, 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--deepspeed" and i + 1 < len(argv):
            config, i = argv[i + 1], i + 2
            continue
        if arg.startswith("--deepspeed="):
            config = arg.split("=", 1)[1]
        else:
            rest.append(arg)
        i += 1
    return config, rest


def main(argv: list[str] | None = None) -> None:
    """python -m zerompi.integrations.transformers SCRIPT [ARGS ...] (module docstring)."""
    global DEFAULT_CONFIG
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.split("\n\n")[1])
        return
    script, (config, rest) = argv[0], _take_config(argv[1:])
    if not os.path.isfile(script):
        raise SystemExit(f"zerompi.integrations.transformers: no script {script}")
    from .distributed import init_process_group
    import transformers

    init_process_group()
    DEFAULT_CONFIG = config
    transformers.Trainer = ZeroTrainer  # `from transformers import Trainer` in the script gets ours
    sys.argv = [script] + rest
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
