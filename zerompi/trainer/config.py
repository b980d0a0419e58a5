"""TrainConfig: the typed, frozen configuration of `python -m zerompi.train`.

Same machinery as ZeroConfig (zerompi/config/zero.py): a TOML/JSON file plus dotted
overrides, unknown keys and bad values fail naming the key. The nested `zero` table is
a ZeroConfig, so `zero.stage=2` or `--zero.optimizer.lr 3e-4` work on the command line.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import typing
from dataclasses import dataclass, field
from typing import Any, Sequence

from ..config import loading as config
from ..config.errors import ConfigError, fail
from ..config.loading import parse_overrides
from ..config.zero import ZeroConfig
from .model_config import ModelConfig
from .schedule import KINDS


@dataclass(frozen=True)
class CheckpointConfig:
    """How `python -m zerompi.train` writes run_dir/checkpoints (when: checkpoint_interval;
    how many are kept: keep_last). docs/checkpoints.md, "Asynchronous saves"."""

    async_save: bool = False
    """true: interval checkpoints are snapshotted into a host buffer (pinned on a GPU, one
    more copy of this rank's optimizer state in host memory) and written in the background
    while training goes on; each is published at a later step boundary once every rank
    wrote its file. false (default): every save blocks all ranks until it is written; on
    a CPU machine with few cores a background write can cost training as much time as the
    synchronous save it replaces (docs/checkpoints.md, "Asynchronous saves", Measured).
    The final and stop-signal checkpoints are always written at once."""
    writer: str = "process"
    """process | thread: where the background write runs, a low-priority helper process
    per rank (no GIL shared with training: its writes finish sooner than the thread's,
    docs/checkpoints.md) or a low-priority thread."""

    def __post_init__(self) -> None:
        if self.writer not in ("thread", "process"):
            fail("writer", self.writer, "must be thread or process")


@dataclass(frozen=True)
class TrainConfig:
    """Everything one training run needs. The engine's settings live in `zero`."""

    model: ModelConfig = field(default_factory=ModelConfig)
    init_from: str = ""
    """A local Hugging Face checkpoint directory (config.json, model.safetensors or
    sharded with model.safetensors.index.json) whose weights start the run, at any stage
    and world size, streamed one tensor at a time (docs/models.md). The model's shape is
    its config.json unless model.config says otherwise. Not used when the run resumes
    from a checkpoint of its own."""
    tokenizer: str = ""
    """The tokenizer the data was made with (a tokenizer.json, or a directory of
    tokenizer files); `python -m zerompi.export --hf` copies its files."""
    data: str = "default"
    """'default' (byte-level Python stdlib, built on first use), a token file (.bin with
    its sidecar or header, Megatron .bin+.idx, llm.c shard, .npy, file.h5[:/dataset]), a
    folder of them, a glob, a comma-separated list, or a `python -m zerompi.prepare`
    output folder (its train/ shards, its val/ ones for validation). docs/data.md."""
    data_val: str = ""
    """Validation tokens, named like data; empty: the last val_fraction of data's tokens
    (or a prepare folder's val/ shards)."""
    data_dtype: str = ""
    """uint8 | uint16 | uint32 | int32: what a headerless token file (no header, no .json
    sidecar) holds. Such a file is refused without it."""
    data_order: str = "epoch"
    """epoch | random. epoch (the default): the non-overlapping windows in epochs without
    replacement, in a seeded order independent of the world size; a resumed run continues
    at the checkpoint's position (data/epoch.py). random: each step draws its windows at
    random (with replacement), seeded by (seed, step)."""
    doc_mask: bool = False
    """No attention across document boundaries: the model gets doc_ids (needs data that
    records its documents: prepare's shards, Megatron .bin+.idx)."""
    val_fraction: float = 0.05
    """Last fraction of the tokens held out for validation (when data_val names none)."""
    block_size: int = 0
    """Tokens per training sequence; 0 = the model's context length (must be <= it)."""
    global_batch: int = 32
    """Sequences per optimizer step, summed over all ranks and micro-steps
    (zero.gradient_accumulation_steps micro-steps per step). Need not divide by the
    ranks: uneven rows are exact (losses weighted by rows), and rank 0 prints a note."""
    max_steps: int = 1000
    """Optimizer steps of the whole run (a resumed run continues up to this)."""
    lr_schedule: str = "cosine"
    """cosine | deepspeed_warmup | deepspeed_warmup_decay | deepspeed_warmup_cosine. cosine:
    linear warm-up over warmup_steps, cosine decay to min_lr at lr_decay_steps. The
    deepspeed_* ones are DeepSpeed's WarmupLR / WarmupDecayLR / WarmupCosineLR exactly
    (warm-up shape: warmup_type), counted in applied updates as DeepSpeed counts them;
    --deepspeed_config maps onto them (trainer/schedule.py)."""
    warmup_type: str = "linear"
    """deepspeed_* schedules: linear | log (DeepSpeed's warmup_type; its default is log)."""
    warmup_steps: int = 100
    """Linear LR warm-up from 0 (deepspeed_*: from warmup_start_lr) to zero.optimizer.lr over this many steps."""
    warmup_start_lr: float = 0.0
    """deepspeed_* schedules: where the warm-up starts (WarmupLR's warmup_min_lr;
    WarmupCosineLR's warmup_min_ratio x lr)."""
    lr_decay_steps: int = 0
    """Cosine decay from zero.optimizer.lr to min_lr ends here; 0 = max_steps."""
    min_lr: float = 1e-4
    """Learning rate at the end of the cosine decay and afterwards (not used by deepspeed_warmup)."""
    eval_interval: int = 100
    """Validate every this many steps and at the end; 0 = never."""
    eval_batches: int = 8
    """Validation batches of global_batch sequences each (capped at one pass over the split)."""
    log_interval: int = 10
    """With progress = lines: print a line at step 1 and every this many steps (and at
    evaluations and the last step); metrics.jsonl gets every step."""
    checkpoint_interval: int = 200
    """Checkpoint every this many steps and at the end; 0 = only at the end and on signals."""
    keep_last: int = 3
    """Checkpoints kept in run_dir/checkpoints (older ones are deleted); 0 = keep all. At
    least 2 are kept: the newest is known good only once a later step was finite."""
    run_dir: str = "runs/default"
    """metrics.jsonl, config.json and checkpoints/ go here; a run restarted with the same
    run_dir resumes from its latest checkpoint."""
    resume: bool = True
    """Resume from run_dir's latest checkpoint if there is one (if it fails verification,
    from the newest one that verifies, said loudly)."""
    resume_from: str = ""
    """Resume from this checkpoint instead: a tag in run_dir/checkpoints or a checkpoint
    directory. Never falls back to another."""
    override_optimizer: bool = False
    """On resume, train on with this config's betas/eps/weight_decay where they differ
    from the checkpoint's (logged); without it such a difference is an error."""
    seed: int = 1337
    """Model initialisation and data order (zero.seed drives per-rank RNG such as dropout)."""
    device: str = "auto"
    """auto | cpu | cuda. auto: cuda when a GPU is visible, else cpu. cuda: each rank takes
    GPU (node-local rank mod visible GPUs); shards, buckets and gathered parameters live
    there, collectives go through zero.comm.backend (auto: NCCL, else MPI on device
    buffers, CUDA-aware or host-staged)."""
    threads: int = 0
    """torch threads per rank; 0 = this node's CPUs divided by its ranks."""
    peak_flops: float = 0.0
    """Peak FLOP/s of one rank, for the MFU estimate; 0 = a rough CPU guess
    (threads x 100 GFLOP/s), so set it on GPUs (H100 SXM dense bf16: 989e12)."""
    progress: str = "auto"
    """auto | bar | lines | none. auto: rank 0 draws a bar with ETA and tokens/s when its
    stdout reaches a terminal (also through mpiexec), else prints plain lines with the
    time left (Slurm logs, pipes); see trainer/progress.py."""
    compile: bool = False
    """torch.compile each repeated block of the model (its transformer layers) in place,
    before the engine wraps it: per-block compile, as torchtitan applies it; every stage.
    The first steps are slow while the blocks compile. Speed: docs/performance.md."""
    compile_backend: str = "inductor"
    """torch.compile's backend with compile = true: inductor (generated kernels; needs a C++
    compiler on CPUs) or another of torch._dynamo.list_backends(), e.g. aot_eager (the
    captured graphs run op by op: for checking what is captured)."""
    tensorboard: bool = False
    """Rank 0 also writes metrics.jsonl's scalars as TensorBoard event files in
    run_dir/tensorboard (needs the tensorboard package: pip install 'zerompi[logging]')."""
    wandb: bool = False
    """Rank 0 also logs metrics.jsonl's scalars to Weights & Biases (needs the wandb package);
    wandb's own variables apply: WANDB_PROJECT (default zerompi), WANDB_MODE=offline (no
    network: the run is kept under run_dir/wandb for `wandb sync`)."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    zero: ZeroConfig = field(default_factory=ZeroConfig)

    def __post_init__(self) -> None:
        if self.init_from and not self.model.config:
            # the checkpoint's own shape, recorded in config.json and checkpoints as such
            try:
                object.__setattr__(self, "model", dataclasses.replace(self.model, config=self.init_from))
            except ConfigError as e:
                fail("init_from", self.init_from, e.why)
        if self.tokenizer and not os.path.exists(self.tokenizer):
            fail("tokenizer", self.tokenizer, "no such file or directory")
        positive = ("global_batch",)
        non_negative = ("block_size", "max_steps", "warmup_steps", "lr_decay_steps", "eval_interval",
                        "checkpoint_interval", "keep_last", "threads")
        for k in positive:
            if getattr(self, k) < 1:
                fail(k, getattr(self, k), "must be >= 1")
        for k in non_negative:
            if getattr(self, k) < 0:
                fail(k, getattr(self, k), "must be >= 0")
        if self.eval_batches < 1:
            fail("eval_batches", self.eval_batches, "must be >= 1")
        if self.log_interval < 1:
            fail("log_interval", self.log_interval, "must be >= 1")
        if not 0.0 <= self.val_fraction < 1.0:
            fail("val_fraction", self.val_fraction, "must be in [0, 1)")
        if self.data_dtype not in ("", "uint8", "uint16", "uint32", "int32"):
            fail("data_dtype", self.data_dtype, "must be uint8, uint16, uint32 or int32")
        if self.data_order not in ("random", "epoch"):
            fail("data_order", self.data_order, "must be random or epoch")
        if self.eval_interval and self.val_fraction == 0 and not self.data_val:
            fail("val_fraction", self.val_fraction, "must be > 0 when eval_interval > 0")
        if self.zero.optimizer.type != "adamw":
            fail("zero.optimizer.type", self.zero.optimizer.type, "the trainer trains with AdamW (SGD and Adagrad "
                 "run through zerompi.initialize)")
        if self.lr_schedule not in KINDS:
            fail("lr_schedule", self.lr_schedule, f"must be one of {', '.join(KINDS)}")
        if self.lr_schedule != "cosine" and self.warmup_steps < 2:
            fail("warmup_steps", self.warmup_steps, f"must be >= 2 with lr_schedule {self.lr_schedule} "
                 "(DeepSpeed warms up over at least 2 steps)")
        if not self.warmup_start_lr >= 0:
            fail("warmup_start_lr", self.warmup_start_lr, "must be >= 0")
        if self.warmup_type not in ("linear", "log"):
            fail("warmup_type", self.warmup_type, "must be linear or log")
        if self.lr_schedule not in ("deepspeed_warmup", "deepspeed_warmup_decay") \
                and not 0.0 <= self.min_lr <= self.zero.optimizer.lr:
            fail("min_lr", self.min_lr, f"must be in [0, zero.optimizer.lr = {self.zero.optimizer.lr}]")
        if self.block_size > self.model.shape().block_size:
            fail("block_size", self.block_size,
                  f"must be <= the model's context length {self.model.shape().block_size}")
        if self.device not in ("auto", "cpu", "cuda"):
            fail("device", self.device, "must be auto, cpu or cuda")
        if self.progress not in ("auto", "bar", "lines", "none"):
            fail("progress", self.progress, "must be auto, bar, lines or none")
        if not self.peak_flops >= 0:
            fail("peak_flops", self.peak_flops, "must be >= 0")
        if not self.data:
            fail("data", self.data, "must name a token source")
        if self.compile and self.zero.tensor_parallel_size > 1:
            fail("compile", True, "is not supported with zero.tensor_parallel_size > 1 yet (untested)")
        if not self.compile_backend.strip():
            fail("compile_backend", self.compile_backend, "must name a torch.compile backend")
        for key, package in (("tensorboard", "tensorboard"), ("wandb", "wandb")):
            if getattr(self, key) and importlib.util.find_spec(package) is None:
                fail(key, True, f"needs the {package} package: pip install {package} "
                     "(or pip install 'zerompi[logging]')")

    @property
    def seq_len(self) -> int:
        return self.block_size or self.model.shape().block_size


def load(source: "str | os.PathLike | dict | None" = None,
         overrides: "dict[str, Any] | Sequence[str] | None" = None) -> TrainConfig:
    """TrainConfig from a TOML/JSON file or dict plus dotted overrides."""
    from ..config.errors import ConfigError

    try:
        return config.load(source, overrides, cls=TrainConfig)
    except ConfigError as e:
        if e.key == "data" and isinstance(e.value, dict) and e.value:
            k, v = next(iter(e.value.items()))  # `data.dtype` / a [data] table: name the key as typed
            flat = {"dtype": "data_dtype", "val": "data_val", "order": "data_order", "doc_mask": "doc_mask"}
            raise ConfigError(f"data.{k}", v, "data is one string (the token source); the other data keys "
                              f"are flat: {flat.get(k, 'data_val, data_dtype, data_order, doc_mask')} "
                              "(docs/data.md)") from None
        raise


def from_argv(argv: Sequence[str]) -> TrainConfig:
    """`--config FILE` (or config=FILE), optionally `--deepspeed_config DS.json`, then
    `--key value` / `key=value` overrides. Which side wins with a DeepSpeed file:
    config/deepspeed/report.RULE (docs/migrating-from-deepspeed.md), printed at start."""
    files, rest = _split_argv(argv)
    if files["deepspeed_config"]:
        return _with_deepspeed(files["config"], files["deepspeed_config"], parse_overrides(rest))
    return load(files["config"], parse_overrides(rest))


def peek(argv: Sequence[str], key: str) -> Any:
    """`key`'s value from --config and the command line, without checking the rest (the
    MPI start-up deadline, read before MPI starts; a DeepSpeed file is not read)."""
    files, rest = _split_argv(argv)
    data = config.read_file(files["config"]) if files["config"] else {}
    for k, v in parse_overrides(rest).items():
        config.set_dotted(data, k, v)
    return value_of(data, key)


def _split_argv(argv: Sequence[str]) -> tuple[dict, list[str]]:
    """({"config": FILE, "deepspeed_config": FILE}, the other arguments)."""
    argv = list(argv)
    files = {"config": None, "deepspeed_config": None}
    rest = []
    i = 0
    while i < len(argv):
        tok = argv[i]
        name = "config" if tok == "-c" else tok.lstrip("-").split("=", 1)[0]
        if name in files and (tok.startswith("--") or tok == "-c" or "=" in tok):
            if "=" in tok:
                files[name], i = tok.split("=", 1)[1], i + 1
                continue
            if i + 1 >= len(argv):
                raise ValueError(f"--{name} needs a file name")
            files[name], i = argv[i + 1], i + 2
            continue
        rest.append(tok)
        i += 1
    return files, rest


def value_of(data: dict, key: str) -> Any:
    """A TrainConfig-dotted key's value in a partial, unchecked config dict (strings from
    the command line included), coerced to its field's type; absent: the default."""
    cls, v, default = TrainConfig, data, TrainConfig()
    for part in key.split("."):
        cls, default = typing.get_type_hints(cls)[part], getattr(default, part)
        v = v.get(part, dataclasses.MISSING) if isinstance(v, dict) else dataclasses.MISSING
    return default if v is dataclasses.MISSING else config.coerce(key, v, cls)


def _dotted(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_dotted(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def _show(v: Any) -> str:
    return f"{v:g}" if isinstance(v, float) else f"({', '.join(_show(x) for x in v)})" if isinstance(v, tuple) \
        else str(v)


def _with_deepspeed(config_path, ds_path: str, overrides: dict) -> TrainConfig:
    """The rule (deepspeed/report.RULE): --config, then what the DeepSpeed file decides
    (DeepSpeed's defaults included), then the command line; said on rank 0 at start."""
    from ..config import deepspeed
    from ..config.deepspeed.report import RULE, announce, effective
    from ..config.errors import ConfigError

    base = config.read_file(config_path) if config_path else {}
    run_data = json.loads(json.dumps(base))
    for k, v in overrides.items():
        config.set_dotted(run_data, k, v)
    ranks, tp = deepspeed.ranks(), value_of(run_data, "zero.tensor_parallel_size")
    if tp < 1 or ranks % tp:
        raise ConfigError("zero.tensor_parallel_size", tp, f"must divide the number of ranks ({ranks})")
    try:
        t = deepspeed.translate(config.read_file(ds_path), ranks, deepspeed.Run(lambda k: value_of(run_data, k),
                                set(overrides)), trainer=True)
    except ConfigError as e:
        raise e.under("deepspeed_config") from None
    data, replaced, beaten = json.loads(json.dumps(base)), [], []
    for key, v in {**_dotted({"zero": t.zero}), **t.trainer}.items():
        tmp: dict = {}
        config.set_dotted(tmp, key, v)
        new, old = value_of(tmp, key), value_of(base, key)
        if key in overrides:
            beaten.append(key)
        elif _dotted(base).get(key, dataclasses.MISSING) is not dataclasses.MISSING and old != new:
            replaced.append(f"{key} {_show(old)} -> {_show(new)}")
        config.set_dotted(data, key, v)
    for k, v in overrides.items():
        config.set_dotted(data, k, v)
    lr, low = value_of(data, "zero.optimizer.lr"), value_of(data, "min_lr")
    if t.lr_key and "zero.optimizer.lr" not in overrides and "min_lr" not in t.trainer \
            and value_of(data, "lr_schedule") != "deepspeed_warmup" and low > lr:
        src = "the command line" if "min_lr" in overrides else f"--config {config_path}" \
            if "min_lr" in base else "zerompi's default"
        raise ConfigError(f"deepspeed_config.{t.lr_key}", lr, "this learning rate from the DeepSpeed file "
                          f"{ds_path}{' (its default: the file leaves it out)' if t.lr_default else ''} is below "
                          f"min_lr = {low:g} from {src}, where the trainer's schedule ends (the file has no "
                          "scheduler); lower min_lr or give the file a scheduler")
    cfg = load(data)
    source = f"DeepSpeed config {ds_path}"
    rule = f"which side wins: {RULE}" + (f"; replaced from --config: {', '.join(replaced)}" if replaced else "") \
        + (f"; the command line replaced the file's {', '.join(beaten)}" if beaten else "")
    announce(t, source, [rule, f"{source}, in effect: {effective(t, cfg.zero, cfg, ranks // tp)}"],
             "zerompi.train")
    return cfg


def describe(cls: type = TrainConfig, prefix: str = "") -> list[str]:
    """One 'key = default' line per leaf field (for --help)."""
    lines = []
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            lines += describe(type(default), key + ".")
        else:
            lines.append(f"  {key} = {json.dumps(default)}")
    return lines


__all__ = ["CheckpointConfig", "ModelConfig", "TrainConfig", "load", "from_argv", "describe"]
