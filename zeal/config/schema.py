"""The typed configuration tree: what can be set, with a description on every field.

Key names follow DeepSpeed's JSON where DeepSpeed has the setting, so a DeepSpeed
config validates as it is; translation of legacy spellings and the list of keys
zeal knows but does not support live in ``ds_compat.py``. Every model forbids
unknown keys, so a typo fails at start-up with the key path.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from zeal.config.compression import CompressionConfig
from zeal.config.data_efficiency import DataEfficiencyConfig, LegacyCurriculumConfig
from zeal.config.lora import LoraConfig
from zeal.config.tiling import TilingConfig

Auto = Literal["auto"]


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


SEED_LIMIT = 2**32  # seeds are scaled (seed · 1_000_003 + epoch) before torch's 64-bit manual_seed

# Hyper-parameters zeal hands to torch, checked here so that an error names the key:
# key -> (lowest, lowest allowed?, highest, highest allowed?) over finite numbers.
_OPTIMIZER_NUMBERS = {
    "lr": (0.0, True, None, False), "eps": (0.0, True, None, False), "weight_decay": (0.0, True, None, False),
    "momentum": (0.0, True, None, False), "dampening": (0.0, True, 1.0, True), "alpha": (0.0, True, None, False),
    "lr_decay": (0.0, True, None, False), "initial_accumulator_value": (0.0, True, None, False),
    "rho": (0.0, True, 1.0, True),
}
_OPTIMIZER_FLAGS = {"amsgrad", "nesterov", "maximize", "capturable", "differentiable", "foreach", "fused",
                    "decoupled_weight_decay"}
_SCHEDULER_NUMBERS = {
    "warmup_min_lr": (0.0, True, None, False), "warmup_max_lr": (0.0, True, None, False),
    "warmup_min_ratio": (0.0, True, 1.0, True), "cos_min_ratio": (0.0, True, 1.0, True),
}
_SCHEDULER_INTS = {"warmup_num_steps": 0, "total_num_steps": 1}


def _is_number(v: Any) -> bool:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    try:
        return math.isfinite(float(v))
    except OverflowError:
        return False


def _check_number(key: str, v: Any, rule: tuple) -> None:
    lo, lo_in, hi, hi_in = rule
    ok = _is_number(v) and (v >= lo if lo_in else v > lo) and (hi is None or (v <= hi if hi_in else v < hi))
    if not ok:
        want = f"{'>=' if lo_in else '>'} {lo:g}" + ("" if hi is None else f" and {'<=' if hi_in else '<'} {hi:g}")
        raise ValueError(f"config key '{key}': must be a finite number {want} (got {v!r:.60})")


def check_optimizer_params(params: dict[str, Any], allow_auto: bool = False) -> None:
    """Raise ValueError naming ``optimizer.params.<key>`` for a value torch would refuse
    (or take silently wrong): rates and decays finite and >= 0, betas two numbers in [0, 1)."""
    for k, v in params.items():
        key = f"optimizer.params.{k}"
        if allow_auto and v == "auto":
            continue
        if k in _OPTIMIZER_NUMBERS:
            _check_number(key, v, _OPTIMIZER_NUMBERS[k])
        elif k == "betas":
            if not isinstance(v, (list, tuple)) or len(v) != 2:
                raise ValueError(f"config key '{key}': must be two numbers in [0, 1) (got {v!r:.60})")
            for i, b in enumerate(v):
                _check_number(f"{key}.{i}", b, (0.0, True, 1.0, False))
        elif k in _OPTIMIZER_FLAGS and not (isinstance(v, bool) or (v is None and k in ("foreach", "fused"))):
            raise ValueError(f"config key '{key}': must be true or false (got {v!r:.60})")


def check_scheduler_params(kind: str, params: dict[str, Any], allow_auto: bool = False) -> None:
    """Raise ValueError naming ``scheduler.params.<key>`` for an out-of-range value: step
    counts integers (warm-up >= 0, total >= 1), rates finite and >= 0, ratios in [0, 1]."""
    for k, v in params.items():
        key = f"scheduler.params.{k}"
        if allow_auto and v == "auto":
            continue
        whole = isinstance(v, int) or (isinstance(v, float) and v.is_integer())  # JSON may write 1e3
        if k in _SCHEDULER_INTS and (isinstance(v, bool) or not whole or v < _SCHEDULER_INTS[k]):
            raise ValueError(f"config key '{key}': must be an integer >= {_SCHEDULER_INTS[k]} (got {v!r:.60})")
        if k in _SCHEDULER_NUMBERS:
            _check_number(key, v, _SCHEDULER_NUMBERS[k])
        if k == "warmup_type" and v not in ("log", "linear"):
            raise ValueError(f"config key '{key}': must be 'log' or 'linear' (got {v!r:.60})")


class OptimizerConfig(Section):
    type: str = Field("AdamW", description="Adam, AdamW, SGD, or any torch.optim class by name.")
    params: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments of the optimizer (lr, betas, eps, weight_decay, ...: "
        "finite, rates and decays >= 0, betas in [0, 1)).")

    @field_validator("params")
    @classmethod
    def _params_in_range(cls, v: dict[str, Any]) -> dict[str, Any]:
        check_optimizer_params(v, allow_auto=True)
        return v


class SchedulerConfig(Section):
    type: Literal["WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest"] = Field(
        ..., description="Learning-rate schedule, stepped once per optimizer step."
    )
    params: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments of the schedule (step counts integers >= 0, "
        "total_num_steps >= 1, rates >= 0, ratios in [0, 1], warmup_type log or linear).")

    @model_validator(mode="after")
    def _params_in_range(self) -> SchedulerConfig:
        check_scheduler_params(self.type, self.params, allow_auto=True)
        return self


class FP16Config(Section):
    enabled: bool = Field(False, description="fp16 compute with fp32 master weights and loss scaling.")
    loss_scale: float = Field(0.0, ge=0, allow_inf_nan=False, description="0 = dynamic loss scaling; > 0 = this static scale.")
    initial_scale_power: int = Field(16, ge=0, le=64, description="Dynamic scaling starts at 2**power.")
    loss_scale_window: int = Field(1000, ge=1, description="Steps without overflow before the scale doubles.")
    hysteresis: int = Field(2, ge=1, description="Overflows tolerated before the scale halves.")
    consecutive_hysteresis: bool = Field(False, description="Refill hysteresis after each good step.")
    min_loss_scale: float = Field(1.0, gt=0, allow_inf_nan=False, description="The scale never drops below this.")


class BF16Config(Section):
    enabled: bool = Field(False, description="bf16 compute with fp32 master weights (no loss scaling).")


class OffloadOptimizerConfig(Section):
    device: Literal["none", "cpu", "nvme"] = Field("none", description="Where optimizer state and step live.")
    nvme_path: str | None = Field(None, description="Folder for swap files when device is nvme.")
    pin_memory: bool = Field(False, description="Use pinned host buffers (CUDA only).")
    buffer_count: int = Field(4, ge=2, description="Swap buffers in the pool.")
    ratio: float = Field(1.0, gt=0, le=1, allow_inf_nan=False, description=(
        "Partial offload (ZeRO-Offload++): the share of parameter units whose masters, moments and update live "
        "on the CPU; the rest stay on the device. 1.0 = all. Device 'cpu' only."))
    fast_init: bool = Field(False, description="Accepted for compatibility; no effect.")

    @model_validator(mode="after")
    def _ratio_needs_cpu(self) -> OffloadOptimizerConfig:
        if self.ratio < 1.0 and self.device == "nvme":
            raise ValueError(f"ratio {self.ratio} < 1 (partial offload) needs device 'cpu'; the nvme tier "
                             "swaps every unit's optimizer state")
        return self


class OffloadParamConfig(Section):
    device: Literal["none", "cpu", "nvme"] = Field("none", description="Where stage-3 parameter shards live.")
    nvme_path: str | None = Field(None, description="Folder for parameter swap files when device is nvme.")
    pin_memory: bool = Field(False, description="Use pinned host buffers (CUDA only).")
    buffer_count: int = Field(5, ge=1, description="Parameter swap buffers.")
    buffer_size: int = Field(100_000_000, ge=1, description="Elements per parameter swap buffer.")
    max_in_cpu: int = Field(1_000_000_000, ge=0, description="Parameter elements kept in CPU memory.")


class ZeroConfig(Section):
    stage: int = Field(0, ge=0, le=3, description="0 = data parallel, 1 = optimizer state, 2 = +gradients, 3 = +parameters partitioned.")
    reduce_bucket_size: int = Field(
        5_000_000, ge=1,
        description="Elements per gradient bucket (stages 0–2 group parameters into buckets of this size, so "
        "reductions overlap backward; also the bound on gradient elements in flight). DeepSpeed's default is 5e8.",
    )
    allgather_bucket_size: int = Field(500_000_000, ge=1, description="Elements per parameter all-gather bucket.")
    overlap_comm: bool = Field(True, description="Launch gradient reductions during backward.")
    contiguous_gradients: bool = Field(True, description="Copy gradients into contiguous buffers (always on).")
    reduce_scatter: bool = Field(True, description="Use reduce-scatter for partitioned gradients (always on).")
    allgather_partitions: bool = Field(True, description="All-gather updated partitions (always on).")
    stage3_prefetch_bucket_size: int = Field(
        1_000_000, ge=0,
        description="Parameter elements prefetched ahead of use along the recorded order (at least the next "
        "module). DeepSpeed's default is 5e7, which on small models gathers nearly everything at once.",
    )
    stage3_param_persistence_threshold: int = Field(100_000, ge=0, description="Modules with at most this many parameter elements stay gathered.")
    stage3_max_live_parameters: int = Field(1_000_000_000, ge=0, description="Gathered elements above which prefetch stops.")
    stage3_max_reuse_distance: int = Field(
        0, ge=0,
        description="Keep a gathered module if it is used again within this many elements of the recorded trace. "
        "zeal defaults to 0 (release after use, like FSDP, except a module used twice in a row); "
        "DeepSpeed's default 1e9 keeps the model gathered between forward and backward, trading "
        "memory for the backward all-gather.",
    )
    stage3_gather_16bit_weights_on_model_save: bool = Field(
        False, description="DeepSpeed's: what engine.zero_gather_16bit_weights_on_model_save() answers (Hugging "
                           "Face / accelerate then save whole weights, else a checkpoint); save_16bit_model always gathers.")
    sub_group_size: int = Field(1_000_000_000, ge=1, description="Elements per optimizer sub-group (offload streaming).")
    offload_optimizer: OffloadOptimizerConfig = Field(
        default_factory=OffloadOptimizerConfig, description="ZeRO-Offload / Infinity: optimizer state on CPU or disk.")
    offload_param: OffloadParamConfig = Field(
        default_factory=OffloadParamConfig, description="ZeRO-Infinity: stage-3 parameter shards on CPU or disk.")
    zero_quantized_weights: bool = Field(False, description="ZeRO++ qwZ: int8 block-quantized weight all-gather.")
    zero_hpz_partition_size: int = Field(1, ge=1, description="ZeRO++ hpZ: ranks in the secondary partition (a node).")
    zero_quantized_gradients: bool = Field(False, description="ZeRO++ qgZ: quantized two-hop gradient reduction.")
    zero_quantized_weights_bits: Literal[4, 8] = Field(8, description="qwZ code width (zeal); 4 halves traffic again at more error.")
    zero_quantized_gradients_bits: Literal[4, 8] = Field(4, description="qgZ code width (zeal); 8 doubles traffic, ~16x less error.")
    zero_quantization_block_size: int = Field(
        256, ge=1,
        description="Elements per quantization block (zeal). Each block sends one fp32 scale: smaller blocks "
        "bound the error tighter (error <= absmax_block / (2·(2^(bits-1)-1))) and cost 4 bytes more per block.",
    )

    @field_validator(
        "reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size",
        "stage3_param_persistence_threshold", "stage3_max_live_parameters", "stage3_max_reuse_distance",
        "sub_group_size", mode="before",
    )
    @classmethod
    def _int_from_float(cls, v: Any) -> Any:
        # DeepSpeed configs often write 5e8.
        if isinstance(v, float) and v.is_integer():
            return int(v)
        return v


class AioConfig(Section):
    block_size: int = Field(1_048_576, ge=512, description="Bytes per I/O request.")
    queue_depth: int = Field(8, ge=1, description="I/O requests in flight.")
    thread_count: int = Field(1, ge=1, description="I/O threads.")
    single_submit: bool = Field(False, description="Accepted for compatibility.")
    overlap_events: bool = Field(True, description="Overlap reads, compute and writes.")


class TensorParallelConfig(Section):
    autotp_size: int = Field(1, ge=0, description="Tensor-parallel ranks per model replica (AutoTP); 0 or 1 = off.")


class CheckpointConfig(Section):
    keep_last: int | None = Field(None, ge=1, description="Keep only the newest K committed checkpoints.")
    fallback_to_previous: bool = Field(False, description="On a corrupt latest tag, load the previous committed one.")


class FlopsProfilerConfig(Section):
    """DeepSpeed's ``flops_profiler``: count the FLOPs of one training step (every forward
    and backward up to its optimizer step) per module, and report them with the step's time."""

    enabled: bool = Field(False, description="Profile one step.")
    profile_step: int = Field(1, ge=1, description="The optimizer step to profile (1 = the first).")
    module_depth: int = Field(-1, ge=-1, description="Depth of the per-module table (-1: every depth).")
    top_modules: int = Field(1, ge=1, description="Modules listed per depth, most FLOPs first.")
    detailed: bool = Field(True, description="Also list each module's operators.")
    output_file: str | None = Field(None, description="Write the report here (rank 0); None: the log.")
    recompute_fwd_factor: float = Field(0.0, ge=0, description="Accepted (recomputed forwards are counted as they run).")


class CompileConfig(Section):
    """DeepSpeed's ``compile`` section: ``torch.compile`` of each transformer block (regional
    compilation: one graph per block class, reused by every layer; ZeRO's gathers, the
    checkpointing wrapper and the loss stay outside the compiled code)."""

    enabled: bool = Field(False, description="Compile each block's forward with torch.compile.")
    backend: str = Field("inductor", description="torch.compile backend (inductor, aot_eager, eager, ...).")
    kwargs: dict = Field(default_factory=dict, description="Further torch.compile keywords (mode, dynamic, ...).")
    disable: bool = Field(False, description="Never compile, whatever 'enabled' says (axolotl's spelling).")
    deepcompile: bool = Field(False, description="DeepSpeed's DeepCompile (refused when true).")


class ActivationCheckpointingConfig(Section):
    """DeepSpeed's ``activation_checkpointing``: present = the model's blocks are
    recomputed in backward (zeal's models per this section; a Hugging Face model
    through its ``gradient_checkpointing_enable()``)."""

    partition_activations: bool = Field(
        False, description="Split each checkpoint across tensor-parallel ranks; refused (not supported yet).")
    cpu_checkpointing: bool = Field(
        False, description="Keep the checkpointed group inputs in pinned CPU memory (CUDA; no effect on CPU).")
    contiguous_memory_optimization: bool = Field(
        False, description="Accepted for compatibility; no effect in zeal (checkpoints stay in torch's allocator).")
    number_checkpoints: int | None = Field(
        None, ge=1, description="Checkpoints over the layer stack: groups of ceil(n_layer / number_checkpoints) "
        "blocks; None = one per block.")
    synchronize_checkpoint_boundary: bool = Field(
        False, description="Accepted for compatibility; no effect in zeal.")
    profile: bool = Field(False, description="Time the recomputation in backward (zeal's models; logged at debug).")
    communication_aware: bool = Field(
        False, description="DeepSpeed-TED's communication-aware checkpointing (zeal's models): the recompute of an "
        "MoE layer reuses the expert-parallel all-to-all outputs saved in forward instead of exchanging again.")

    @field_validator("partition_activations")
    @classmethod
    def _no_partitioning(cls, v: bool) -> bool:
        if v:
            raise ValueError("partition_activations (activation checkpoints split over tensor parallelism) "
                             "is not supported by zeal yet")
        return v


class PipelineConfig(Section):
    """Pipeline parallelism (``zeal.pipe``): the model split into ``size`` stages; one
    optimizer step runs ``micro_batches`` micro-batches through the ``schedule``."""

    size: int = Field(1, ge=1, description="Pipeline stages (1 = off); divides the world with tp.")
    micro_batches: int | None = Field(
        None, ge=1, description="Micro-batches per optimizer step (default: gradient_accumulation_steps; "
                                "given, they must agree).")
    schedule: Literal["1f1b", "gpipe", "interleaved"] = Field(
        "1f1b", description="1f1b (at most `size` micro-batches in flight), gpipe (all forwards, then all "
                            "backwards), interleaved (Megatron's 1F1B over `virtual_stages` model chunks per stage).")
    virtual_stages: int = Field(
        1, ge=1, description="Model chunks per stage for the interleaved schedule (Megatron's "
                             "virtual_pipeline_model_parallel_size): >= 2 with 'interleaved', else 1.")
    partition_method: Literal["parameters", "uniform"] = Field(
        "parameters", description="How a zeal.pipe.PipelineModule's layers are split: balanced parameter "
                                  "counts, or equal layer counts.")


class Config(Section):
    """The whole engine configuration (DeepSpeed JSON keys)."""

    train_batch_size: int | Auto | None = Field(None, description="Global batch = micro × accumulation × world.")
    train_micro_batch_size_per_gpu: int | Auto | None = Field(None, description="Samples per rank per forward.")
    gradient_accumulation_steps: int | Auto | None = Field(None, description="Micro-batches per optimizer step.")
    optimizer: OptimizerConfig | None = Field(None, description="Optimizer built by zeal when none is passed.")
    scheduler: SchedulerConfig | None = Field(None, description="LR schedule built by zeal when none is passed.")
    gradient_clipping: float = Field(0.0, ge=0, allow_inf_nan=False, description="Clip the global gradient norm to this (0 = off).")
    fp16: FP16Config = Field(default_factory=FP16Config, description="fp16 mixed precision with loss scaling.")
    bf16: BF16Config = Field(default_factory=BF16Config, description="bf16 mixed precision.")
    zero_optimization: ZeroConfig = Field(default_factory=ZeroConfig, description="ZeRO stage, buckets, offload, ZeRO++.")
    aio: AioConfig = Field(default_factory=AioConfig, description="Asynchronous disk I/O of the nvme tier.")
    tensor_parallel: TensorParallelConfig = Field(
        default_factory=TensorParallelConfig, description="Tensor parallelism: attention and MLP split over ranks.")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, description="Checkpoint retention and fallback.")
    flops_profiler: FlopsProfilerConfig = Field(default_factory=FlopsProfilerConfig,
                                                description="FLOPs of one step per module (DeepSpeed's section).")
    compile: CompileConfig = Field(default_factory=CompileConfig,
                                   description="torch.compile of each block (DeepSpeed's compile section).")
    activation_checkpointing: ActivationCheckpointingConfig | None = Field(
        None, description="Recompute activations in backward (None = as the model itself says).")
    tiling: TilingConfig = Field(default_factory=TilingConfig,
                                 description="ALST tiling: TiledMLP and the tiled logits loss (docs/long_context.md).")
    compression: CompressionConfig = Field(default_factory=CompressionConfig,
                                           description="N:M sparsity (magnitude, ADMM) and quantization-aware training.")
    lora: LoraConfig = Field(default_factory=LoraConfig, description="LoRA / QLoRA adapters on a frozen base "
                             "(zeal.lora; applied before every other step).")
    steps_per_print: int = Field(10, ge=1, description="Log every N optimizer steps (rank 0).")
    wall_clock_breakdown: bool = Field(False, description="Time forward, backward, reduce, step and gather.")
    seed: int = Field(1234, ge=0, lt=SEED_LIMIT,
                      description="Seed for meta-device materialisation, and for the data order of "
                                  "initialize(training_data=) when given (unset: 0, DeepSpeed's) (0 <= seed < 2**32).")
    dataloader_drop_last: bool = Field(False, description="The loader of initialize(training_data=) leaves out "
                                       "each rank's last partial micro-batch (DeepSpeed's key).")
    dist_backend: Literal["gloo", "nccl"] | None = Field(None, description="None = nccl on CUDA, gloo on CPU.")
    local_world_size: int | None = Field(None, ge=1, description="Ranks per node (default: torchrun's LOCAL_WORLD_SIZE).")
    comm_timeout_s: float | None = Field(
        None, gt=0, allow_inf_nan=False,
        description="Seconds a collective may wait before it fails and leaves hang-forensics records "
                    "(ZEAL_COMM_TIMEOUT_S overrides; default 600).")
    sequence_parallel_size: int = Field(
        1, ge=1, description="DeepSpeed-Ulysses sequence parallelism: each sequence sharded over this many ranks "
                             "of the data-parallel group (their all-to-all attention sees every token); "
                             "the batch arithmetic counts world / (tp x pp x this) data-parallel ranks.")
    pipeline_parallel: PipelineConfig = Field(default_factory=PipelineConfig,
                                              description="Pipeline parallelism: stages, micro-batches, schedule.")
    data_efficiency: DataEfficiencyConfig = Field(default_factory=DataEfficiencyConfig,
                                                  description="Curriculum learning and random-LTD (DeepSpeed keys).")
    curriculum_learning: LegacyCurriculumConfig | None = Field(
        None, description="DeepSpeed's legacy sequence-length curriculum (curriculum_type seqlen).")

    @field_validator("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    @classmethod
    def _positive(cls, v: Any, info: Any) -> Any:
        if isinstance(v, int) and v < 1:
            raise ValueError(f"{info.field_name} must be >= 1, got {v}")
        return v

    @model_validator(mode="after")
    def _precision(self) -> Config:
        if self.fp16.enabled and self.bf16.enabled:
            raise ValueError("fp16.enabled and bf16.enabled are both true; choose one")
        z = self.zero_optimization
        if z.offload_param.device != "none" and z.stage != 3:
            raise ValueError(
                f"zero_optimization.offload_param.device={z.offload_param.device!r} needs zero_optimization.stage 3, got {z.stage}"
            )
        if z.offload_optimizer.device != "none" and z.stage == 0:
            raise ValueError("zero_optimization.offload_optimizer needs zero_optimization.stage >= 1")
        for key in ("zero_quantized_weights", "zero_quantized_gradients"):
            if getattr(z, key) and z.stage != 3:
                raise ValueError(f"zero_optimization.{key} (ZeRO++) needs zero_optimization.stage 3, got {z.stage}")
        if self.pipeline_parallel.size > 1 and z.stage == 3:
            raise ValueError("pipeline_parallel.size > 1 with zero_optimization.stage 3 is not supported "
                             "(as in DeepSpeed): use stage 0, 1 or 2")
        if z.zero_hpz_partition_size > 1 and z.stage != 3:
            raise ValueError(f"zero_optimization.zero_hpz_partition_size needs zero_optimization.stage 3, got {z.stage}")
        for key, sec in (("offload_optimizer", z.offload_optimizer), ("offload_param", z.offload_param)):
            if sec.device == "nvme" and not sec.nvme_path:
                raise ValueError(f"zero_optimization.{key}.nvme_path is required when device is 'nvme'")
        return self

    def resolve_batch(self, world_size: int) -> tuple[int, int, int]:
        """(train_batch_size, micro_batch, accumulation) from any two of the three;
        raises ValueError naming the rule when they disagree."""
        tb, mb, ga = (None if v == "auto" else v for v in (
            self.train_batch_size, self.train_micro_batch_size_per_gpu, self.gradient_accumulation_steps))
        if tb is not None and mb is not None and ga is not None:
            if tb != mb * ga * world_size:
                raise ValueError(
                    f"train_batch_size {tb} != micro {mb} × accum {ga} × world {world_size}"
                )
        elif tb is not None and mb is not None:
            ga, rem = divmod(tb, mb * world_size)
            if rem or ga < 1:
                raise ValueError(
                    f"train_batch_size {tb} is not divisible by micro {mb} × world {world_size}"
                )
        elif tb is not None and ga is not None:
            mb, rem = divmod(tb, ga * world_size)
            if rem or mb < 1:
                raise ValueError(
                    f"train_batch_size {tb} is not divisible by accum {ga} × world {world_size}"
                )
        elif tb is not None:
            ga = 1
            mb, rem = divmod(tb, world_size)
            if rem or mb < 1:
                raise ValueError(f"train_batch_size {tb} is not divisible by world {world_size}")
        else:
            mb = mb or 1
            ga = ga or 1
        return mb * ga * world_size, mb, ga
