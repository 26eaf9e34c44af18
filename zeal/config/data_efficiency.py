"""DeepSpeed's data-efficiency sections, typed: ``data_efficiency`` (curriculum learning by
difficulty metrics, random-LTD) and the legacy top-level ``curriculum_learning`` (the
sequence-length warm-up). Key names are DeepSpeed's; what they do is in
:mod:`zeal.data.curriculum`, :mod:`zeal.data.curriculum_sampler` and :mod:`zeal.data.random_ltd`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

SCHEDULES = ("fixed_linear", "fixed_root", "fixed_discrete", "custom")

# metric names that need no index: realised on the batch (DeepSpeed's post-processing)
SEQLEN_TRUNCATE = ("seqlen_truncate", "seqtru", "seqlen")
SEQLEN_RESHAPE = ("seqlen_reshape", "seqres")
VOC = ("voc", "vocabularyrarity", "vocabulary_rarity")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class PacingConfig(_Section):
    """A pacing function: ``schedule_type`` and its ``schedule_config`` between
    ``min_difficulty`` and ``max_difficulty`` (see :class:`zeal.data.curriculum.Pacing`)."""

    min_difficulty: int = Field(..., ge=0, description="Difficulty at step 0.")
    max_difficulty: int = Field(..., ge=0, description="Difficulty once the curriculum ends.")
    schedule_type: Literal["fixed_linear", "fixed_root", "fixed_discrete", "custom"] = Field(
        "fixed_linear", description="Pacing function of the global step.")
    schedule_config: dict[str, Any] = Field(
        default_factory=dict, description="fixed_linear/fixed_root: total_curriculum_step, difficulty_step "
        "(+ root_degree); fixed_discrete: difficulty (k values), max_step (k-1 values).")

    @model_validator(mode="after")
    def _schedule(self) -> PacingConfig:
        if getattr(self, "enabled", True) is False:
            return self  # an off legacy section asks for nothing
        check_schedule(self.schedule_type, self.schedule_config, self.min_difficulty, self.max_difficulty)
        return self


def check_schedule(kind: str, sc: dict[str, Any], lo: int, hi: int) -> None:
    """Raise ValueError naming the ``schedule_config`` key that is missing or out of range."""
    if hi < lo:
        raise ValueError(f"max_difficulty {hi} is below min_difficulty {lo}")
    if kind in ("fixed_linear", "fixed_root"):
        allowed = {"total_curriculum_step", "difficulty_step"} | ({"root_degree"} if kind == "fixed_root" else set())
        _only(sc, allowed)
        for key in sorted(allowed):
            v = sc.get(key)
            if not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
                raise ValueError(f"schedule_config.{key}: {kind} needs an integer >= 1 (got {v!r:.40})")
    elif kind == "fixed_discrete":
        _only(sc, {"difficulty", "max_step"})
        d, m = sc.get("difficulty"), sc.get("max_step")
        if not (isinstance(d, list) and d and all(isinstance(x, int) for x in d)):
            raise ValueError("schedule_config.difficulty: fixed_discrete needs a non-empty list of integers")
        if not (isinstance(m, list) and len(m) == len(d) - 1 and all(isinstance(x, int) for x in m)):
            raise ValueError(f"schedule_config.max_step: fixed_discrete needs {len(d) - 1} integers "
                             f"(one fewer than difficulty), got {m!r:.60}")
        if any(b <= a for a, b in zip(m, m[1:])):
            raise ValueError("schedule_config.max_step must be increasing")


def _only(sc: dict[str, Any], allowed: set[str]) -> None:
    extra = sorted(set(sc) - allowed)
    if extra:
        raise ValueError(f"schedule_config.{extra[0]}: unknown key (expected {', '.join(sorted(allowed))})")


class CurriculumMetricConfig(PacingConfig):
    """One difficulty metric of ``curriculum_metrics`` (keyed by its name: ``seqlen_truncate``,
    ``seqlen_reshape``, ``voc``/``vocabularyrarity`` or any metric with an analyzer index)."""

    index_to_sample_path: str | None = Field(None, description="Analyzer output: sample ids sorted by metric (.npy).")
    index_to_metric_path: str | None = Field(None, description="Analyzer output: each sample's metric (.npy).")
    difficulty_type: Literal["value", "percentile"] = Field("value", description="Bound on the metric value, or on "
                                                            "its percentile (1..max_difficulty).")
    clustering_type: Literal["schedule_based", "single_cluster"] = Field(
        "schedule_based", description="single_cluster: no index, the metric is applied to the batch (seqlen).")


class CurriculumLearningConfig(_Section):
    enabled: bool = Field(False, description="Sample by difficulty metrics with pacing functions.")
    data_cluster_path: str | None = Field(None, description="Accepted for compatibility (zeal keeps clusters in memory).")
    curriculum_metrics: dict[str, CurriculumMetricConfig] = Field(
        default_factory=dict, description="Metric name -> its index and pacing function.")


class DataSamplingConfig(_Section):
    enabled: bool = Field(True, description="The data-sampling part of data efficiency.")
    num_epochs: int = Field(1000, ge=1, description="Epochs the sampler may draw from.")
    num_workers: int = Field(0, ge=0, description="Data-loader workers.")
    pin_memory: bool = Field(False, description="Pinned host buffers (CUDA only).")
    curriculum_learning: CurriculumLearningConfig = Field(default_factory=CurriculumLearningConfig,
                                                          description="Curriculum learning by difficulty metrics.")


class RandomLTDScheduleConfig(_Section):
    min_value: int = Field(..., ge=1, description="Kept tokens per wrapped layer at step 0.")
    max_value: int = Field(..., ge=1, description="Kept tokens at the end (the full sequence length).")
    schedule_type: Literal["fixed_linear"] = Field("fixed_linear", description="Only fixed_linear (as DeepSpeed).")
    schedule_config: dict[str, int] = Field(
        default_factory=dict, description="require_steps (steps to reach max_value), seq_per_step (rounding).")

    @model_validator(mode="after")
    def _keys(self) -> RandomLTDScheduleConfig:
        if self.max_value < self.min_value:
            raise ValueError(f"random_ltd_schedule.max_value {self.max_value} < min_value {self.min_value}")
        _only(self.schedule_config, {"require_steps", "seq_per_step"})
        for key in ("require_steps", "seq_per_step"):
            v = self.schedule_config.get(key)
            if not (isinstance(v, int) and v >= 1):
                raise ValueError(f"random_ltd_schedule.schedule_config.{key}: needs an integer >= 1 (got {v!r:.40})")
        return self


class LayerTokenLRConfig(_Section):
    enabled: bool = Field(False, description="LR warm-up and decay by consumed layer-tokens.")
    total_layer_tokens: int | None = Field(None, ge=1, description="Layer-tokens of the whole run (decay end).")
    warmup_type: Literal["linear", "cosine", "constant"] = Field("linear", description="Decay after warm-up.")
    warmup_layer_tokens: int = Field(0, ge=0, description="Layer-tokens of the linear warm-up.")


class RandomLTDConfig(_Section):
    enabled: bool = Field(False, description="Random layerwise token dropping.")
    total_layer_num: int | None = Field(None, ge=1, description="Layers of the model (checked against it).")
    random_ltd_layer_num: int | None = Field(None, ge=0, description="How many layers drop tokens.")
    random_ltd_layer_id: list[int] | None = Field(None, description="Which layers drop tokens (0-based); default: "
                                                  "every layer but the first and the last.")
    model_mask_name: str = Field("attention_mask", description="Keyword of the attention mask (HF layers).")
    model_type: Literal["decoder", "encoder"] = Field("decoder", description="decoder: causal mask.")
    hidden_state_order: Literal["batch_seq_dim", "seq_batch_dim"] = Field(
        "batch_seq_dim", description="Layout of the hidden states the layers get.")
    random_ltd_schedule: RandomLTDScheduleConfig | None = Field(None, description="Kept-token schedule.")
    layer_token_lr_schedule: LayerTokenLRConfig = Field(default_factory=LayerTokenLRConfig,
                                                        description="The LayerToken LR schedule.")

    @model_validator(mode="after")
    def _layers(self) -> RandomLTDConfig:
        if not self.enabled:
            return self
        if self.random_ltd_schedule is None:
            raise ValueError("data_routing.random_ltd.random_ltd_schedule is required when random_ltd is enabled")
        ids = self.random_ltd_layer_id
        if ids is not None:
            if len(set(ids)) != len(ids) or any(i < 0 for i in ids):
                raise ValueError("random_ltd_layer_id must list distinct layer indices >= 0")
            if self.random_ltd_layer_num is not None and self.random_ltd_layer_num != len(ids):
                raise ValueError(f"random_ltd_layer_num {self.random_ltd_layer_num} != "
                                 f"len(random_ltd_layer_id) {len(ids)}")
        return self


class DataRoutingConfig(_Section):
    enabled: bool = Field(True, description="The data-routing part of data efficiency.")
    random_ltd: RandomLTDConfig = Field(default_factory=RandomLTDConfig, description="Random-LTD.")


class DataEfficiencyConfig(_Section):
    """DeepSpeed's ``data_efficiency`` section."""

    enabled: bool = Field(False, description="Data efficiency on (curriculum learning and/or random-LTD).")
    seed: int = Field(1234, ge=0, lt=2**32, description="Seed of the curriculum sampler and of random-LTD.")
    data_sampling: DataSamplingConfig = Field(default_factory=DataSamplingConfig, description="Curriculum sampling.")
    data_routing: DataRoutingConfig = Field(default_factory=DataRoutingConfig, description="Random-LTD.")

    def curriculum(self) -> CurriculumLearningConfig | None:
        """The curriculum section when it is on (all enclosing ``enabled`` flags true)."""
        s = self.data_sampling
        on = self.enabled and s.enabled and s.curriculum_learning.enabled
        return s.curriculum_learning if on else None

    def random_ltd(self) -> RandomLTDConfig | None:
        """The random-LTD section when it is on."""
        r = self.data_routing
        return r.random_ltd if self.enabled and r.enabled and r.random_ltd.enabled else None


class LegacyCurriculumConfig(PacingConfig):
    """DeepSpeed's legacy top-level ``curriculum_learning``: a sequence-length warm-up."""

    enabled: bool = Field(False, description="Sequence-length curriculum on.")
    curriculum_type: Literal["seqlen"] = Field("seqlen", description="Only seqlen (as DeepSpeed).")
    min_difficulty: int = Field(8, ge=1, description="Sequence length at step 0.")
    max_difficulty: int = Field(1024, ge=1, description="Full sequence length.")
