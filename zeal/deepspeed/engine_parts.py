"""The tables and small helpers behind :class:`zeal.deepspeed.engine.DeepSpeedEngine`:
which zeal names the facade forwards, which DeepSpeed names it refuses and why, the
ZeRO config readers, and DeepSpeed's ``monitor`` / ``tput_timer`` objects."""

from __future__ import annotations

import time

# zeal engine attributes readable on the facade as they are (DeepSpeed has the same names)
_DELEGATED = frozenset({
    "optimizer", "lr_scheduler", "global_steps", "global_samples", "micro_steps", "skipped_steps", "mesh",
    "sharded_state", "gathered_parameters", "iter_gathered_parameters", "comm_stats", "is_first_stage",
    "is_last_stage", "tensor_parallel", "close",
})

_REASONS = {
    "autotuning_*": "zeal has no autotuner; `zeal estimate` picks a ZeRO stage for a memory budget",
    "compile_*": "call torch.compile on the model before deepspeed.initialize",
    "get_compile_time": "zeal does not compile the engine",
    "register_compile_pass": "zeal has no DeepCompile",
    "is_deepcompile_*": "zeal has no DeepCompile",
    "get_deepcompile_backend": "zeal has no DeepCompile",
    "get_deepspeed_compile_backend": "zeal has no DeepCompile",
    "get_autosp_backend": "zeal has no sequence-parallel compile backend",
    "get_autotp_backend": "zeal applies tensor parallelism from the config (tensor_parallel.autotp_size)",
    "uses_parallelization_pass_only": "zeal has no DeepCompile",
    "sparse_*": "zeal reduces dense gradients only",
    "allreduce_*": "zeal reduces gradients itself at the accumulation boundary (engine.backward/step)",
    "buffered_allreduce_fallback": "zeal reduces gradients itself at the accumulation boundary",
    "all_gather_scalar": "use deepspeed.comm.all_gather",
    "no_sync": "zeal reduces only at the accumulation boundary: set gradient_accumulation_steps or call "
               "set_gradient_accumulation_boundary(False)",
    "coalesce_grad_reduction": "zeal buckets gradient reductions itself (zero_optimization.reduce_bucket_size)",
    "offload_states": "zeal's offload is configured (zero_optimization.offload_*), not toggled at run time",
    "reload_states": "zeal's offload is configured (zero_optimization.offload_*), not toggled at run time",
    "empty_partition_cache": "zeal's ZeRO-3 releases gathered parameters after each use; nothing is cached",
    "deepspeed_io": "pass training_data= to deepspeed.initialize (the engine's loader is returned third)",
    "memory_breakdown": "zeal reports bytes per rank with engine.engine.memory_breakdown()",
    "load_universal_checkpoint": "zeal's checkpoints load at any world size and ZeRO stage as they are",
    "load_moe_state_dict": "engine.load_checkpoint loads MoE experts with the rest",
    "zenflow_config": "zeal has no ZenFlow",
    "super_offload": "zeal has no SuperOffload",
    "set_custom_curriculum_learning_schedule": "set the schedule in data_efficiency.data_sampling.curriculum_learning",
    "set_data_post_process_func": "zeal's curriculum sampler has no post-process hook",
    "random_ltd_initialize": "random-LTD starts from the config (data_efficiency.data_routing.random_ltd)",
    "print_forward_breakdown": "use engine.engine.wall_clock_breakdown()",
    "get_wall_clock_timers": "use engine.engine.wall_clock_breakdown()",
    "clip_fp32_gradients": "clipping is configured (gradient_clipping) and done in engine.step()",
    "scale": "engine.backward(loss) scales the loss itself",
    "get_data_types": "zeal's data types come from the fp16 / bf16 sections",
    "communication_data_type": "zeal reduces gradients in fp32 (or ZeRO++ quantized); it is not a setting",
    "half": "precision comes from the config (fp16 / bf16 sections)",
    "float": "precision comes from the config (fp16 / bf16 sections)",
    "double": "precision comes from the config (fp16 / bf16 sections)",
    "bfloat16": "precision comes from the config (fp16 / bf16 sections)",
    "type": "precision comes from the config (fp16 / bf16 sections)",
    "cuda": "the engine's device is chosen at initialize (LOCAL_RANK's GPU)",
    "cpu": "the engine's device is chosen at initialize (offload: zero_optimization.offload_*)",
    "xpu": "zeal runs on CUDA or the CPU",
    "ipu": "zeal runs on CUDA or the CPU",
    "mtia": "zeal runs on CUDA or the CPU",
    "to_empty": "the engine's parameters are placed by ZeRO at initialize",
    "share_memory": "the engine's parameters are placed by ZeRO at initialize",
    "get_type": "read engine.optimizer.param_groups",
    "zero_legacy_stage1": "zeal has no legacy stage 1",
    "zero_elastic_checkpoint": "zeal's checkpoints load at any world size (no elastic flag)",
    "checkpoint_*": "zeal's checkpoints are safetensors + JSON with a checksummed manifest; tag validation, "
                    "writers and serialization are not settings",
    "cpuadam_cores_perc": "zeal's offloaded optimizer runs on torch's CPU threads (torch.set_num_threads)",
    "dump_state": "use engine.engine.memory_breakdown() / engine.engine.comm_stats()",
    "get_optimizer_configuration": "read optimizer_name() / optimizer_params() / engine.optimizer",
    "log_level": "zeal logs through the logging module: set deepspeed.utils.logger's level",
    "swap_tensor_config": "zeal's NVMe offload is zero_optimization.offload_*.nvme_path with the aio section "
                          "(aio_config())",
    "is_sanity_checks_enabled": "DeepSpeed-internal ZeRO-3 checks; zeal has none to switch",
    "zero_log_trace_cache_warnings": "DeepSpeed-internal; zeal's ZeRO-3 traces no module order",
    "zero_multi_rank_bucket_allreduce": "DeepSpeed-internal; zeal buckets reductions itself",
    "zero_allgather_sequential": "DeepSpeed-internal; zeal gathers one flat unit per collective",
    "zero_compute_grad_norm": "zeal computes the gradient norm when clipping: engine.get_global_grad_norm()",
    "zero_parameter_alignment": "zeal aligns its flat units itself",
    "zero_model_persistence_threshold": "zeal bounds persistence per module (stage3_param_persistence_threshold)",
    "zero_module_granularity_threshold": "zeal gathers whole flat units",
    "zero_save_muon_momentum_buffer_in_memory": "zeal has no Muon",
}

# DeepSpeed accessors whose answer is fixed by how zeal works (their setting is accepted
# only with this value, or zeal always behaves so): the facade returns it
_FIXED = {
    "zero_ignore_unused_parameters": True,  # unused parameters are always allowed
    "zero_load_from_fp32_weights": True,  # zeal's checkpoints hold fp32 masters
    "zero_quantized_nontrainable_weights": False,  # the setting is refused when True
    "zero_round_robin_gradients": False,  # no round-robin copy order
    "managed_gradient_accumulation": True,  # the engine accumulates (False is refused)
    "use_node_local_storage": False,  # True is refused
    "optimizer_legacy_fusion": False,
    "gradient_predivide_factor": 1.0,  # gradients are averaged once, in fp32
    "postscale_gradients": True,  # averaged after the reduction (prescale_gradients has no effect)
}
_MOVES = frozenset({"half", "float", "double", "bfloat16", "type", "cuda", "cpu", "xpu", "ipu", "mtia", "to_empty",
                    "share_memory"})

# DeepSpeed's ZeRO accessors that read one field of zeal's zero_optimization section
_ZERO_FIELDS = {
    "zero_reduce_bucket_size": "reduce_bucket_size", "zero_allgather_bucket_size": "allgather_bucket_size",
    "zero_overlap_comm": "overlap_comm", "zero_contiguous_gradients": "contiguous_gradients",
    "zero_reduce_scatter": "reduce_scatter", "zero_allgather_partitions": "allgather_partitions",
    "zero_prefetch_bucket_size": "stage3_prefetch_bucket_size",
    "zero_param_persistence_threshold": "stage3_param_persistence_threshold",
    "zero_max_live_parameters": "stage3_max_live_parameters", "zero_max_reuse_distance": "stage3_max_reuse_distance",
    "zero_gather_16bit_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
    "zero_sub_group_size": "sub_group_size", "zero_quantized_weights": "zero_quantized_weights",
    "zero_quantized_gradients": "zero_quantized_gradients", "zero_hpz_partition_size": "zero_hpz_partition_size",
    "zero_offload_optimizer": "offload_optimizer", "zero_offload_param": "offload_param",
}


class Monitor:
    """DeepSpeed's ``engine.monitor``: ``enabled`` is False (zeal writes its metrics to the
    run folder; DeepSpeed's tensorboard / csv / wandb sections are not read), so
    ``write_events`` writes nothing, as DeepSpeed's does with no monitor configured."""

    enabled = False

    def write_events(self, event_list: list) -> None:
        """Write ``[(name, value, step), ...]`` to the enabled monitors (none)."""
        del event_list


class ThroughputTimer:
    """DeepSpeed's ``engine.tput_timer``: samples per second over the optimizer steps
    the engine has run (timed from one ``step`` boundary to the next)."""

    def __init__(self, batch_size: int) -> None:
        self.batch_size = batch_size
        self.global_step_count = 0
        self.epoch_count = 0
        self.total_elapsed_time = 0.0
        self._last: float | None = None

    def update(self, batch_size: int) -> None:
        now = time.perf_counter()
        if self._last is not None:
            self.total_elapsed_time += now - self._last
            self.global_step_count += 1
        self._last, self.batch_size = now, batch_size

    def update_epoch_count(self) -> None:
        """Count a finished epoch (scripts call it at each epoch's end)."""
        self.epoch_count += 1

    def avg_samples_per_sec(self) -> float:
        """Mean samples per second per step so far (-inf before two steps, as DeepSpeed)."""
        if self.global_step_count == 0 or self.total_elapsed_time == 0:
            return float("-inf")
        return self.batch_size * self.global_step_count / self.total_elapsed_time


def flops_field(name: str) -> str | None:
    """``flops_profiler_profile_step`` -> ``profile_step`` (a field of the flops_profiler section)."""
    from zeal.config.schema import FlopsProfilerConfig

    field = name.removeprefix("flops_profiler_")
    return field if field != name and field in FlopsProfilerConfig.model_fields else None
