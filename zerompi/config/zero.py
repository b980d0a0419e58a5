"""ZeroConfig and its sections: typed, frozen, validating themselves.

A config comes from a dict, a JSON or TOML file, or an existing `ZeroConfig`, plus
command-line-style overrides (``optimizer.lr=3e-4`` or ``["--optimizer.lr", "3e-4"]``).
Unknown keys and bad values raise ``ValueError`` naming the dotted key and the value,
so a typo in a batch script fails on every rank before any collective is issued.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from .errors import fail

PRECISIONS = ("fp32", "bf16", "fp16")


@dataclass(frozen=True)
class OptimizerConfig:
    """The optimizer: AdamW (decoupled weight decay, as torch.optim.AdamW), or torch's SGD or
    Adagrad (elementwise updates, so they partition exactly; zerompi/optim/elementwise.py)."""

    type: str = "adamw"
    """adamw | sgd | adagrad. sgd and adagrad use momentum/dampening/nesterov and
    lr_decay/initial_accumulator_value below, weight_decay as torch (L2, in the gradient),
    and run as torch ops (implementation auto or torch; no offload)."""
    lr: float = 1e-3
    """Learning rate; may be changed during training through ``engine.param_groups``."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Exponential decay rates of the first and second moments."""
    eps: float = 1e-8
    """Added to the denominator for numerical stability."""
    weight_decay: float = 0.01
    """Decoupled weight decay (multiplies the parameter by 1 - lr * weight_decay)."""
    implementation: str = "auto"
    """auto | torch | fused. torch: torch ops per segment (on the CPU bitwise
    torch.optim.AdamW). fused: the table-driven CUDA kernels (cuda_src/adamw_table.cu),
    one launch per step for the whole shard; on the CPU their numpy references (slow; the
    GPU's arithmetic bit for bit, for checking a GPU run). auto: fused on a GPU with
    cupy, torch otherwise. With offload_optimizer = cpu the host updates: fused is then
    torch's fused CPU AdamW (one pass over memory, not bitwise the single-tensor path),
    auto picks it when the model is on a GPU, torch ops otherwise."""

    momentum: float = 0.0
    """sgd: momentum factor."""
    dampening: float = 0.0
    """sgd: dampening of the momentum."""
    nesterov: bool = False
    """sgd: Nesterov momentum (needs momentum > 0 and dampening 0, as torch)."""
    lr_decay: float = 0.0
    """adagrad: the learning rate is lr / (1 + (step - 1) lr_decay)."""
    initial_accumulator_value: float = 0.0
    """adagrad: the sum of squared gradients starts here."""

    def __post_init__(self) -> None:
        if self.type not in ("adamw", "sgd", "adagrad"):
            fail("type", self.type, "must be adamw, sgd or adagrad (others are refused: docs/migrating-from-deepspeed.md)")
        if self.type != "adamw" and self.implementation == "fused":
            fail("implementation", self.implementation, f"the fused kernels are AdamW's; {self.type} runs as torch ops")
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            fail("nesterov", self.nesterov, "needs momentum > 0 and dampening 0 (as torch.optim.SGD)")
        for k in ("momentum", "dampening", "lr_decay", "initial_accumulator_value"):
            if not getattr(self, k) >= 0:
                fail(k, getattr(self, k), "must be >= 0")
        if self.implementation not in ("auto", "torch", "fused"):
            fail("implementation", self.implementation, "must be auto, torch or fused")
        if not self.lr >= 0:
            fail("lr", self.lr, "must be >= 0")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            fail("betas", self.betas, "must be two numbers in [0, 1)")
        if not self.eps > 0:
            fail("eps", self.eps, "must be > 0")
        if not self.weight_decay >= 0:
            fail("weight_decay", self.weight_decay, "must be >= 0")


@dataclass(frozen=True)
class LossScaleConfig:
    """Dynamic loss scaling for fp16 (ignored for bf16/fp32)."""

    initial_scale: float = 2.0**16
    """Loss scale of the first step."""
    window: int = 1000
    """Steps without overflow after which the scale is multiplied by `factor`."""
    hysteresis: int = 2
    """Overflows tolerated (step skipped, scale kept) before the scale is lowered."""
    min_scale: float = 1.0
    """The scale never goes below this; overflowing at the minimum raises an error."""
    factor: float = 2.0
    """Multiplier for raising and divisor for lowering the scale."""

    def __post_init__(self) -> None:
        if not self.initial_scale > 0:
            fail("initial_scale", self.initial_scale, "must be > 0")
        if self.window < 1:
            fail("window", self.window, "must be >= 1")
        if self.hysteresis < 1:
            fail("hysteresis", self.hysteresis, "must be >= 1")
        if not 0 < self.min_scale <= self.initial_scale:
            fail("min_scale", self.min_scale, "must be in (0, initial_scale]")
        if not self.factor > 1:
            fail("factor", self.factor, "must be > 1")


@dataclass(frozen=True)
class CommConfig:
    """Collective communication."""

    backend: str = "auto"
    """auto | mpi | nccl. auto: NCCL for GPU tensors when every rank has its own GPU and
    cupy with NCCL, MPI otherwise (CUDA-aware or host-staged for GPU tensors); nccl where
    it cannot run (no cupy/GPU, CPU tensors, ranks sharing a GPU) is a config error.
    The engine builds its grid for the model's device (initialize with dims=None; the
    trainer with --device)."""
    reduce_scatter: str = "ordered"
    """ordered: alltoall + sum in rank order, bitwise independent of bucket size;
    native: the library's reduce-scatter (faster on some fabrics, order not fixed)."""
    timeout_s: float = 300.0
    """Deadline of every collective wait once the first optimizer step is done: a rank
    still waiting after this names itself, the collective, the step and the ranks that did
    not arrive, and ends the job (exit 3; zerompi/runtime/watchdog.py). 0 = no deadline."""
    startup_timeout_s: float = 1200.0
    """The same deadline before the first optimizer step (set-up, data caches, first
    gathers) and for checkpoint save/load, where ranks wait for the slowest writer."""
    stop_grace_s: float = 10.0
    """After SIGTERM/SIGINT, a wait longer than this means the ranks cannot agree to
    checkpoint: the job ends without one (exit 128 + signal). 0 = wait as long as the
    deadlines above allow."""
    hierarchical: str = "auto"
    """auto | on | off: two-level reduce-scatter and all-gather for shard_group "world"
    (inside the node, then across nodes; comm/hierarchy.py). Each rank then sends 1/P of
    a flat alltoall's bytes over the inter-node link (P ranks per node) in P - 1 + M - 1
    steps instead of N - 1 (M nodes). auto: on when the data-parallel group spans
    several nodes with several of its ranks on each. Gathers are bitwise the same;
    sums are added node by node ((g0 + g1) + (g2 + g3)), so results differ from flat
    ones in the last bits (within the parity floor), still independent of the bucket
    size. Stage 0 and other shard groups: flat. With reduce_scatter "native" the
    reduce-scatter is the library's flat one (only the all-gather has two levels)."""

    def __post_init__(self) -> None:
        if self.hierarchical not in ("auto", "on", "off"):
            fail("hierarchical", self.hierarchical, "must be auto, on or off")
        for k in ("timeout_s", "startup_timeout_s", "stop_grace_s"):
            if not getattr(self, k) >= 0:
                fail(k, getattr(self, k), "must be >= 0 (0 = off)")
        if self.backend not in ("auto", "mpi", "nccl"):
            fail("backend", self.backend, "must be one of auto, mpi, nccl")
        if self.reduce_scatter not in ("ordered", "native"):
            fail("reduce_scatter", self.reduce_scatter, "must be ordered or native")


@dataclass(frozen=True)
class Stage3Config:
    """Stage-3 parameter gathering (ignored for stages 0-2)."""

    prefetch_modules: int = 1
    """How many upcoming module groups are all-gathered ahead of use (0 = no prefetch)."""
    max_live_parameters: int = 1 << 28
    """Upper bound on gathered (full) parameter elements alive at once, prefetch included."""
    persistence_threshold: int = 0
    """Parameters with at most this many elements stay resident on every rank."""
    unit_classes: str = "auto"
    """Module classes whose subtrees are gathered as one unit: "auto" (the repeated blocks
    of a ModuleList/Sequential, e.g. transformer layers) or comma-separated class names
    ("GPT2Block,MyExpertLayer"). The model itself is always a unit (zero/stage3/units.py)."""
    unit_min_elements: int = 0
    """Also make a unit of any other module whose unclaimed subtree holds at least this
    many elements (0: off)."""
    coalesce_elements: int | str = "auto"
    """Merge consecutive sibling units (e.g. layers h.0 + h.1) into one unit, gathered
    and reduced together, while the group holds fewer than this many elements, so each
    rank's chunk of its collectives stays large at large N. "auto": the bucket, when
    bucket_size "auto" is above its 2^22 floor (the bucket is then a floor on the per-rank
    chunk); otherwise 0 (off). An integer: that target at any N (zero/stage3/units.py)."""
    secondary_partition: int | str = "off"
    """off | node | K: ZeRO++'s hpZ. After a unit's forward all-gather each rank keeps its
    slice of the low-precision unit over a small group (its node's data-parallel ranks,
    or K consecutive ones), and backward re-gathers the unit inside that group only,
    instead of across the whole shard group. Costs 1/P of the low-precision parameters
    per rank (P = the group's size; memory_report()["secondary"]). Refilled by every
    forward gather (so never stale after an update or a load); the values are copies,
    so results are bitwise those without it (zero/stage3/secondary.py). K = 1 is off."""

    def __post_init__(self) -> None:
        if self.prefetch_modules < 0:
            fail("prefetch_modules", self.prefetch_modules, "must be >= 0")
        if self.max_live_parameters < 1:
            fail("max_live_parameters", self.max_live_parameters, "must be >= 1")
        if self.persistence_threshold < 0:
            fail("persistence_threshold", self.persistence_threshold, "must be >= 0")
        if not self.unit_classes.strip() or any(not c.strip() for c in self.unit_classes.split(",")):
            fail("unit_classes", self.unit_classes, 'must be "auto" or comma-separated class names')
        if self.unit_min_elements < 0:
            fail("unit_min_elements", self.unit_min_elements, "must be >= 0")
        sp = self.secondary_partition
        if sp not in ("off", "node") and not (isinstance(sp, int) and not isinstance(sp, bool) and sp >= 1):
            fail("secondary_partition", sp, 'must be "off", "node" or an integer >= 1 (ranks per group)')
        if self.coalesce_elements != "auto" and not (isinstance(self.coalesce_elements, int)
                                                     and self.coalesce_elements >= 0):
            fail("coalesce_elements", self.coalesce_elements, 'must be "auto" or an integer >= 0')


@dataclass(frozen=True)
class ActivationCheckpointingConfig:
    """ZeRO-R activation checkpointing of the model's blocks (the repeated children of a
    ModuleList/Sequential, as stage 3's "auto" units): each block keeps only its input
    and is recomputed during backward (docs/activation-checkpointing.md). DeepSpeed's
    `activation_checkpointing` block maps onto this table."""

    enabled: bool = False
    """Checkpoint every block (keep its input, recompute it in backward)."""
    partition: bool = False
    """Pa: each tensor-parallel rank keeps 1/tp of every kept input and the slices are
    all-gathered over tp before recomputation (DeepSpeed partition_activations). With
    tensor_parallel_size 1 a logged no-op."""
    cpu_offload: bool = False
    """Pa+cpu: kept inputs (slices with partition) wait in host memory between forward
    and backward; the next block's input is brought back one block ahead
    (DeepSpeed cpu_checkpointing)."""
    contiguous: bool = False
    """MD: kept inputs live in one persistent preallocated buffer per dtype, sized on the
    first step and reused (DeepSpeed contiguous_memory_optimization)."""

    def __post_init__(self) -> None:
        for k in ("partition", "cpu_offload", "contiguous"):
            if getattr(self, k) and not self.enabled:
                fail(k, getattr(self, k), "needs activation_checkpointing.enabled = true")


@dataclass(frozen=True)
class OffloadConfig:
    """How the offloaded optimizer (offload_optimizer = cpu) runs; docs/offload.md."""

    pipeline: str = "auto"
    """auto | staged | copy. staged: each gradient bucket is copied to host staging in its
    own dtype as backward completes it (its own CUDA stream on a GPU), one fused host pass
    (unscale, clip, AdamW, the cast) writes the parameter-dtype copy into host staging,
    uploaded tile by tile while the pass goes on; the norm and overflow check run where
    the gradient is. copy: the whole gradient shard copied to an fp32 host buffer at the
    step, then optimizer.implementation's update. auto: staged with the model on a GPU
    (unless implementation = torch or tensor_parallel_size > 1), copy otherwise."""
    delayed_update: bool = False
    """ZeRO-Offload's one-step delayed parameter update: the host pass of step t runs while
    the device computes step t+1, whose forward and backward therefore use the parameters
    before update t (update t+1 applies a gradient taken one update earlier). Needs the
    staged pipeline, bf16/fp16 and tensor_parallel_size 1."""
    threads: int | str = "auto"
    """Threads of the host pass, or auto: this rank's share of the node's cores (the cores
    it may run on divided by the ranks on its node, unless the launcher bound it to fewer),
    one fewer with the delayed update (the training thread keeps a core)."""
    host_pass: str = "auto"
    """auto | compiled | torch: the host pass compiled from cuda_src/host_adamw.cpp at first
    use (bit for bit the CUDA kernels' arithmetic), or torch's fused AdamW and a cast;
    auto: compiled, else torch with the reason logged; compiled: fail if it cannot build."""
    tile_elements: int = 1 << 25
    """Elements per upload tile (64 MiB of bf16): the upload of one tile overlaps the host
    pass over the next."""

    def __post_init__(self) -> None:
        if self.pipeline not in ("auto", "staged", "copy"):
            fail("pipeline", self.pipeline, "must be auto, staged or copy")
        if self.host_pass not in ("auto", "compiled", "torch"):
            fail("host_pass", self.host_pass, "must be auto, compiled or torch")
        if self.threads != "auto" and not (isinstance(self.threads, int) and self.threads >= 1):
            fail("threads", self.threads, 'must be "auto" or an integer >= 1')
        if self.tile_elements < 1:
            fail("tile_elements", self.tile_elements, "must be >= 1")


@dataclass(frozen=True)
class ZeroConfig:
    """Everything the engine needs. Field names of DESIGN.md section 4 are stable."""

    stage: int = 0
    """0: plain data parallel (all-reduce); 1: partitioned optimizer states;
    2: + partitioned gradients; 3: + partitioned parameters."""
    precision: str = "fp32"
    """fp32 | bf16 | fp16. bf16/fp16 keep fp32 master weights for the rank's shard."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    gradient_accumulation_steps: int = 1
    """Micro-batches per optimizer step (engine.step() updates on every n-th call)."""
    gradient_clipping: float = 0.0
    """Max global L2 norm of the gradient; 0 disables clipping."""
    bucket_size: int | str = "auto"
    """Elements per communication bucket (also the partition block, see docs), or "auto":
    2^22 at small N (2^26 when the model is on a GPU, where each bucket's fixed host cost
    matters more than its memory; none at all on one data-parallel rank, which
    communicates nothing), growing with N so every rank's chunk of a collective stays large
    enough that latency is a small part of its time, sized for the narrowest collective
    (2-byte elements in bf16/fp16 runs at stages 1-3, whose all-gathers move the param
    dtype; stage 0 only all-reduces, in the reduce dtype) and
    capped at 1 GiB of it: 2^28 elements in fp32, 2^29 in bf16/fp16 (buffers of ~8.6 GiB
    per rank at large N with fp32 reduction; an integer caps them, reduce_dtype "param"
    halves them; zerompi/comm/cost_model.py auto_bucket_elements; docs/scaling.md).
    Each span (the model, a stage-3 unit) is cut into balanced blocks: at most this many
    elements (an integer, or "auto" at its floor), or with "auto" above the floor at
    least this many (then stage-3 units are coalesced to it too,
    stage3.coalesce_elements). Each of the `bucket_count` slots
    holds ~2.5 of the largest block (send, alltoall receive, own chunk) in the reduce
    dtype: 2^22 elements = 16 MiB per bucket (DDP uses 25 MB buckets)."""
    bucket_count: int = 2
    """Buckets in flight at once: one filling while the others reduce."""
    reduce_dtype: str = "fp32"
    """dtype in which gradients are summed across ranks (fp32 or the param dtype)."""
    grad_accum_dtype: str = "param"
    """dtype of stored gradients between micro-steps: 'param' (the paper's memory
    numbers) or 'fp32' (exact accumulation, +2 bytes per stored element in bf16/fp16)."""
    buffer_dtype: str = "keep"
    """Floating buffers (BatchNorm statistics, a rotary inv_freq) in bf16/fp16 runs: keep
    (their own dtype, as DeepSpeed >= 0.19.2), fp32, or param (cast with the parameters)."""
    alignment: int = 16
    """Each parameter starts at a multiple of this many elements in the flat buffer."""
    shard_group: int | str = "world"
    """world | node | K: where stages 1-3 partition their states (hybrid sharding: MiCS,
    FSDP's HSDP). world: over all N data-parallel ranks. node: over the data-parallel
    ranks of each node, replicated across nodes. K: over groups of K consecutive
    data-parallel ranks (K divides N). Gradients are reduce-scattered inside the group,
    then each shard is all-reduced across the N / K groups; parameter gathers never
    leave the group. States per rank: the stage's formula with N -> K. Stage 0 ignores
    it. Checkpoints are the same format whatever the group (zero/groups.py)."""
    fp16: LossScaleConfig = field(default_factory=LossScaleConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    stage3: Stage3Config = field(default_factory=Stage3Config)
    activation_checkpointing: ActivationCheckpointingConfig = field(default_factory=ActivationCheckpointingConfig)
    offload_optimizer: str = "none"
    """none | cpu (ZeRO-Offload). cpu: the fp32 master weights, Adam moments and a copy of
    the rank's gradient shard live in host memory (pinned on a GPU) and the AdamW update
    runs on the host; parameters and gradients stay on the model's device. Same results
    as none; less device memory, a host<->device copy of the shard per step."""
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    tensor_parallel_size: int = 1
    """Ranks per tensor-parallel group (adjacent ranks); data parallelism (and ZeRO's
    partitioning) runs across groups. It must divide the number of ranks; the model must
    be tensor-parallel already (zerompi.parallel.parallelize for the reference GPT)."""
    seed: int = 1234
    """Base seed; rank r seeds torch/numpy/random with seed + r."""
    max_nonfinite_steps: int = 3
    """fp32/bf16: stop (precision.Diverged) after this many optimizer steps in a row
    whose loss or gradient was inf/nan (each is skipped and logged); 0 = never stop.
    fp16 stops when it overflows at fp16.min_scale instead."""

    def __post_init__(self) -> None:
        if self.stage not in (0, 1, 2, 3):
            fail("stage", self.stage, "must be 0, 1, 2 or 3")
        if self.precision not in PRECISIONS:
            fail("precision", self.precision, f"must be one of {', '.join(PRECISIONS)}")
        if self.gradient_accumulation_steps < 1:
            fail("gradient_accumulation_steps", self.gradient_accumulation_steps, "must be >= 1")
        if not self.gradient_clipping >= 0:
            fail("gradient_clipping", self.gradient_clipping, "must be >= 0 (0 = off)")
        if self.bucket_size != "auto" and not (isinstance(self.bucket_size, int) and self.bucket_size >= 1):
            fail("bucket_size", self.bucket_size, 'must be "auto" or an integer >= 1')
        if self.bucket_count < 1:
            fail("bucket_count", self.bucket_count, "must be >= 1")
        if self.reduce_dtype not in ("fp32", "param"):
            fail("reduce_dtype", self.reduce_dtype, "must be fp32 or param")
        if self.buffer_dtype not in ("keep", "fp32", "param"):
            fail("buffer_dtype", self.buffer_dtype, "must be keep, fp32 or param")
        if self.grad_accum_dtype not in ("fp32", "param"):
            fail("grad_accum_dtype", self.grad_accum_dtype, "must be fp32 or param")
        sg = self.shard_group
        if sg not in ("world", "node") and not (isinstance(sg, int) and not isinstance(sg, bool) and sg >= 1):
            fail("shard_group", sg, 'must be "world", "node" or an integer >= 1 (ranks per group)')
        if sg != "world" and self.comm.hierarchical == "on":
            fail("comm.hierarchical", "on", f'two-level collectives are for shard_group "world" '
                 f"(shard_group is {sg!r}: its gathers stay inside the group already); use auto or off")
        if self.alignment < 1 or self.alignment & (self.alignment - 1):
            fail("alignment", self.alignment, "must be a power of two")
        if self.max_nonfinite_steps < 0:
            fail("max_nonfinite_steps", self.max_nonfinite_steps, "must be >= 0 (0 = never stop)")
        if self.offload_optimizer not in ("none", "cpu"):
            fail("offload_optimizer", self.offload_optimizer, "must be none or cpu")
        if self.offload_optimizer == "cpu" and self.optimizer.type != "adamw":
            fail("offload_optimizer", self.offload_optimizer, f"the offloaded optimizer is AdamW's; "
                 f"optimizer.type {self.optimizer.type} does not offload")
        if self.offload.delayed_update:
            why = ("needs offload_optimizer = cpu" if self.offload_optimizer != "cpu" else
                   "needs the staged pipeline" if self.offload.pipeline == "copy" else
                   "needs bf16 or fp16: in fp32 the device parameters are the master, read back "
                   "as such (full_state_dict, checkpoints), and a copy one update behind cannot be"
                   if self.precision == "fp32" else
                   "needs tensor_parallel_size 1: replicated gradients are averaged over tp "
                   "after backward, once they have left the device" if self.tensor_parallel_size > 1
                   else None)
            if why:
                fail("offload.delayed_update", True, why)
        if self.tensor_parallel_size < 1:
            fail("tensor_parallel_size", self.tensor_parallel_size, "must be >= 1")
