"""DeepSpeed's engine accessors on :class:`zeal.deepspeed.engine.DeepSpeedEngine`: the
ranks and sizes, the batch, the step counters, and the config readers (``fp16_enabled()``,
``gradient_clipping()``, ``zero_*`` ...). zeal's own engine (``self.engine``, a
:class:`~zeal.train.engine.TrainEngine`) answers in zeal's names; these say the same in
DeepSpeed's, so that scripts written for DeepSpeed run unchanged."""

from __future__ import annotations

import os
from typing import Any

import torch


class DeepSpeedAccessors:
    """DeepSpeed's accessor names over ``self.engine`` (mixed into the facade; no state of its own)."""

    @property
    def device(self) -> torch.device:
        return self.engine.device

    @property
    def config(self) -> Any:
        """The config as given to ``initialize``, a dict as DeepSpeed keeps it (Hugging Face
        reads ``engine.config.get("zero_optimization", {})``); zeal's validated ``Config`` is
        ``engine.engine.config``."""
        raw = self.__dict__.get("_ds_config")
        return raw if raw is not None else self.engine.config

    @property
    def training_dataloader(self) -> Any:
        """The loader built from ``training_data`` (None without it)."""
        return self.engine.dataloader

    @property
    def global_rank(self) -> int:
        """This process's rank in the job."""
        return self.engine.mesh.rank

    @property
    def local_rank(self) -> int:
        """This process's rank on its node."""
        return int(os.environ.get("LOCAL_RANK", 0))

    @property
    def world_size(self) -> int:
        return self.engine.mesh.world_size

    @property
    def dp_world_size(self) -> int:
        """Data-parallel ranks reading different samples (ZeRO shards over them × the sp ranks)."""
        return self.engine.mesh.data_size

    @property
    def seq_dp_world_size(self) -> int:
        """Data × sequence parallel ranks: the group ZeRO shards over."""
        return self.engine.mesh.dp_size

    @property
    def sequence_parallel_size(self) -> int:
        return self.engine.mesh.sp_size

    def get_sequence_parallel_group(self) -> Any:
        """The process group of this rank's sequence-parallel (Ulysses) ranks; None at size 1."""
        return self.engine.mesh.sp.group if self.engine.mesh.sp.active else None

    @property
    def mp_world_size(self) -> int:
        """Model-parallel (tensor-parallel) ranks."""
        return self.engine.mesh.tp_size

    @property
    def num_stages(self) -> int:
        """Pipeline stages (1 without a pipeline)."""
        return self.engine.mesh.pp_size

    @property
    def stage_id(self) -> int:
        return self.engine.mesh.pp_rank

    def get_data_parallel_rank(self) -> int:
        return self.engine.mesh.data_rank

    def get_model_parallel_rank(self) -> int:
        return self.engine.mesh.tp_rank

    def get_tensor_parallel_rank(self) -> int:
        return self.engine.mesh.tp_rank

    def was_step_applied(self) -> bool:
        """Whether the last optimizer step updated the model (False after an fp16 overflow)."""
        return self._applied

    def get_batch_info(self) -> tuple[int, int, int]:
        """``(train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps)``."""
        return self.train_batch_size(), self.train_micro_batch_size_per_gpu(), self.gradient_accumulation_steps()

    def set_train_batch_size(self, train_batch_size: int) -> None:
        """Change the global batch by changing the accumulation steps (the micro-batch and
        the data-parallel size stay); it must be a multiple of ``micro · dp``."""
        per = self.train_micro_batch_size_per_gpu() * self.dp_world_size
        if train_batch_size % per or train_batch_size < per:
            raise ValueError(f"set_train_batch_size({train_batch_size}): must be a multiple of micro batch x data "
                             f"parallel size = {per}")
        self.engine.grad_accum = train_batch_size // per

    def set_train_micro_batch_size(self, micro_batch_size: int) -> None:
        """Change the micro-batch (the accumulation steps stay; the global batch follows)."""
        if micro_batch_size < 1:
            raise ValueError(f"set_train_micro_batch_size({micro_batch_size}): must be >= 1")
        self.engine.micro_batch = micro_batch_size

    # the batch, the step and the schedule, in DeepSpeed's names (zeal's engine: micro_batch,
    # grad_accum, at_boundary, set_boundary, grad_norm, zero_stage, token_drop)
    def train_micro_batch_size_per_gpu(self) -> int:
        """Samples per rank per forward."""
        return self.engine.micro_batch

    def gradient_accumulation_steps(self) -> int:
        """Micro-batches per optimizer step."""
        return self.engine.grad_accum

    def train_batch_size(self) -> int:
        """Samples per optimizer step over all data-parallel ranks."""
        return self.engine.micro_batch * self.engine.grad_accum * self.engine.mesh.data_size

    def zero_optimization_stage(self) -> int:
        """The ZeRO stage."""
        return self.engine.zero_stage

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the current micro-step ends the accumulation (then ``step`` updates)."""
        return self.engine.at_boundary

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """The current micro-step (until ``step``) ends the accumulation, or does not,
        whatever ``gradient_accumulation_steps`` says; the loss is then the caller's to scale."""
        self.engine.set_boundary(is_boundary)

    def get_global_grad_norm(self) -> float | None:
        """Norm of the (unscaled, unclipped) mean gradient at the last step."""
        return self.engine.grad_norm

    def get_lr(self) -> list[float]:
        """The learning rate of every param group."""
        return [g["lr"] for g in self.engine.optimizer.param_groups]

    @property
    def random_ltd_scheduler(self) -> Any:
        """random-LTD's schedule and state (``state``, ``get_current_seq()``; zeal's
        :class:`zeal.data.random_ltd.TokenDrop`, ``engine.token_drop``), None when it is off."""
        return self.engine.token_drop

    def random_ltd_enabled(self) -> bool:
        """Whether random-LTD is on."""
        return self.engine.token_drop is not None

    def fp16_enabled(self) -> bool:
        return self.engine.config.fp16.enabled

    def bfloat16_enabled(self) -> bool:
        return self.engine.config.bf16.enabled

    def fp16_auto_cast(self) -> bool:
        """False: zeal casts the inputs to the compute dtype, the model runs in it."""
        return False

    def torch_autocast_enabled(self) -> bool:
        return False

    def torch_autocast_dtype(self) -> None:
        return None

    def torch_autocast_lower_precision_safe_modules(self) -> list:
        return []

    def fp16_master_weights_and_gradients(self) -> bool:
        return False  # zeal keeps fp32 masters

    def bf16_master_weights_and_gradients(self) -> bool:
        return False  # zeal keeps fp32 masters

    def bf16_optimizer_states(self) -> bool:
        return False  # fp32 optimizer states

    def loss_scale(self) -> float:
        """The config's static loss scale (0: dynamic), as DeepSpeed's ``loss_scale()``; the
        current dynamic scale is ``engine.optimizer.cur_scale`` there, ``engine.engine.loss_scale`` here."""
        return self.engine.config.fp16.loss_scale

    def dynamic_loss_scale(self) -> bool:
        return self.engine.config.fp16.enabled and self.engine.config.fp16.loss_scale == 0

    def initial_dynamic_scale(self) -> float:
        return float(2 ** self.engine.config.fp16.initial_scale_power)

    def dynamic_loss_scale_args(self) -> dict | None:
        f = self.engine.config.fp16
        if not self.dynamic_loss_scale():
            return None
        return {"init_scale": 2 ** f.initial_scale_power, "scale_window": f.loss_scale_window,
                "delayed_shift": f.hysteresis, "consecutive_hysteresis": f.consecutive_hysteresis,
                "min_scale": f.min_loss_scale}

    def gradient_clipping(self) -> float:
        """The clipping norm (0: none)."""
        return self.engine.config.gradient_clipping

    def steps_per_print(self) -> int:
        return self.engine.config.steps_per_print

    def wall_clock_breakdown(self) -> bool:
        """Whether the config asks for timings (DeepSpeed's meaning; zeal's timings:
        ``engine.engine.wall_clock_breakdown()``)."""
        return self.engine.config.wall_clock_breakdown

    def optimizer_name(self) -> str | None:
        spec = self.engine.config.optimizer
        return spec.type if spec else None

    def optimizer_params(self) -> dict | None:
        spec = self.engine.config.optimizer
        return dict(spec.params) if spec else None

    def scheduler_name(self) -> str | None:
        spec = self.engine.config.scheduler
        return spec.type if spec else None

    def scheduler_params(self) -> dict | None:
        spec = self.engine.config.scheduler
        return dict(spec.params) if spec else None

    def get_mom(self) -> list:
        """Each param group's momentum (Adam: its betas)."""
        return [g.get("betas", g.get("momentum")) for g in self.optimizer.param_groups]

    def zero_optimization(self) -> bool:
        """Whether ZeRO is on (stage > 0)."""
        return self.engine.config.zero_optimization.stage > 0

    def zero_optimization_partition_gradients(self) -> bool:
        return self.engine.config.zero_optimization.stage >= 2

    def zero_optimization_partition_weights(self) -> bool:
        return self.engine.config.zero_optimization.stage >= 3

    def zero_cpu_offload(self) -> bool:
        return self.engine.config.zero_optimization.offload_optimizer.device == "cpu"

    def zero_use_cpu_optimizer(self) -> bool:
        return self.engine.config.zero_optimization.offload_optimizer.device in ("cpu", "nvme")

    def zero_nvme_offload_optimizer(self) -> bool:
        return self.engine.config.zero_optimization.offload_optimizer.device == "nvme"

    def zero_partial_offload(self) -> float:
        return self.engine.config.zero_optimization.offload_optimizer.ratio

    def data_efficiency_enabled(self) -> bool:
        return self.engine.config.data_efficiency.enabled

    def data_sampling_enabled(self) -> bool:
        return self.engine.config.data_efficiency.data_sampling.enabled

    def curriculum_learning_enabled(self) -> bool:
        de = self.engine.config.data_efficiency
        legacy = self.engine.config.curriculum_learning
        return bool(de.data_sampling.curriculum_learning.enabled or (legacy is not None and legacy.enabled))

    def zero_allow_untested_optimizer(self) -> bool:
        """True: zeal runs any elementwise torch optimizer under ZeRO."""
        return True

    def zero_force_ds_cpu_optimizer(self) -> bool:
        """False: zeal's offloaded optimizer is the configured torch one."""
        return False

    def data_efficiency_config(self) -> Any:
        return self.engine.config.data_efficiency

    def data_sampling_config(self) -> Any:
        return self.engine.config.data_efficiency.data_sampling

    def curriculum_learning_config(self) -> Any:
        return self.engine.config.data_efficiency.data_sampling.curriculum_learning

    def random_ltd_config(self) -> Any:
        return self.engine.config.data_efficiency.data_routing.random_ltd

    def tensor_parallel_config(self) -> Any:
        return self.engine.config.tensor_parallel

    def autotp_size(self) -> int:
        return self.engine.config.tensor_parallel.autotp_size

    def aio_config(self) -> Any:
        return self.engine.config.aio

    def dataloader_drop_last(self) -> bool:
        """True: the loader built from ``training_data`` drops the last partial batch."""
        return True

    @staticmethod
    def is_map_style_dataset(obj: Any) -> bool:
        return hasattr(obj, "__getitem__") and hasattr(obj, "__len__")

    @staticmethod
    def is_iterable_style_dataset(obj: Any) -> bool:
        return isinstance(obj, torch.utils.data.IterableDataset)

    def is_first_weights_partition_group(self) -> bool:
        """Whether the weights are partitioned (ZeRO-3), as DeepSpeed answers it."""
        return self.zero_optimization_partition_weights()

    def collect_python_gc(self) -> int:
        """Run Python's cyclic garbage collector now (a safe point the script chose); the
        number of objects collected."""
        import gc

        return gc.collect()
