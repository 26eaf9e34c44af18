"""The ``inference`` section of the configuration tree: what ``zeal serve`` and
``zeal.inference.LLM`` can be told. ``zeal serve``'s flags are derived from these
fields (name, type, default and help), so each default is stated here once."""

from __future__ import annotations

import json
import typing
from typing import Literal

from pydantic import Field, field_validator, model_validator

from zeal.config.process import ProcessConfig
from zeal.config.schema import Section
from zeal.utils.hardware import cpu_has_native_bf16

# accepted spellings of the model's dtype -> torch dtype name ("auto": resolve_dtype below)
DTYPE_NAMES: dict[str, str] = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
                               "float16": "float16", "fp16": "float16", "auto": "auto"}
DType = Literal["auto", "float32", "fp32", "bfloat16", "bf16", "float16", "fp16"]


def resolve_dtype(name: str, device: str) -> str:
    """A dtype name of :data:`DTYPE_NAMES` → the torch dtype's name. ``auto``: bfloat16 where
    the hardware computes it natively (a CUDA GPU with bf16, a CPU with bf16 dot products),
    float16 on other GPUs, float32 elsewhere; any other name as given."""
    name = DTYPE_NAMES[name]
    if name != "auto":
        return name
    if device.startswith("cuda"):
        import torch

        return "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "float16"
    return "bfloat16" if device == "cpu" and cpu_has_native_bf16() else "float32"


def check_weights_offload(kind: str, max_resident_gb: float | None, quant: str) -> None:
    """ZeRO-Inference's settings together: a streamed layer store needs its budget, and its
    storage (``quant``) means nothing without one. ValueError naming the field otherwise."""
    if quant != "none" and kind == "none":
        raise ValueError(f"weights_offload_quant {quant!r} needs weights_offload 'disk' or 'cpu' "
                         "(it sets how the streamed layers are stored)")
    if kind != "none" and max_resident_gb is None:
        raise ValueError(f"weights_offload {kind!r} needs max_resident_weights_gb")


class SpeculativeConfig(Section):
    """Speculative decoding (vLLM's ``speculative_config``): ``method="ngram"`` drafts the next
    tokens by prompt lookup, ``method="draft_model"`` by greedy decoding with a smaller
    ``model`` of the same tokenizer; one forward pass verifies them; greedy requests only."""

    method: Literal["ngram", "draft_model"] = Field(
        "ngram", description="ngram: drafts by prompt lookup (n-gram matching); draft_model: drafts by the "
        "greedy tokens of the draft 'model'.")
    model: str | None = Field(
        None, description="draft_model: the draft's HF folder or .gguf file (same tokenizer as the target; "
        "loaded in the target's dtype and device).")
    num_speculative_tokens: int = Field(4, ge=1, le=64, description="Tokens drafted per step.")
    prompt_lookup_max: int = Field(4, ge=1, description="Longest suffix n-gram looked up in the context.")
    prompt_lookup_min: int = Field(1, ge=1, description="Shortest suffix n-gram looked up in the context.")

    @model_validator(mode="after")
    def _ngram_range(self) -> SpeculativeConfig:
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative_config: method 'draft_model' needs 'model' (the draft's folder)")
        if self.method == "ngram" and self.model:
            raise ValueError("speculative_config: 'model' is for method 'draft_model', not 'ngram'")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config: prompt_lookup_min ({self.prompt_lookup_min}) exceeds "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")
        return self


class LoRAModulePath(Section):
    """One adapter served from start-up (vLLM's ``--lora-modules`` entry)."""

    name: str = Field(min_length=1, description="The name requests give as 'model' to use the adapter.")
    path: str = Field(min_length=1, description="A PEFT adapter folder (adapter_config.json + "
                      "adapter_model.safetensors).")
    base_model_name: str | None = Field(None, description="Accepted for vLLM compatibility (the served base "
                                        "model is the parent).")


class LoRAServingConfig(Section):
    """Multi-LoRA serving (vLLM's flags): PEFT adapters over the one base model, picked per
    request by its 'model' field, adapters of different requests batched in one pass
    (zeal.inference.multi_lora)."""

    enable_lora: bool = Field(False, description="Serve LoRA adapters (implied by lora_modules).")
    lora_modules: list[LoRAModulePath] = Field(
        default_factory=list, description="Adapters to serve from start-up: name=path entries, or vLLM's JSON "
        '{"name": ..., "path": ...}.')
    max_loras: int = Field(8, ge=1, description="Most adapters loaded at once (each holds a slot; its requests "
                           "batch with any others).")
    max_lora_rank: int = Field(16, ge=1, description="Highest adapter rank accepted.")
    allow_runtime_lora_updating: bool = Field(
        False, description="Enable POST /v1/load_lora_adapter and /v1/unload_lora_adapter (also turned on by "
        "vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING=true).")

    @field_validator("lora_modules", mode="before")
    @classmethod
    def _parse(cls, v: object) -> object:
        if isinstance(v, str | dict):
            v = [v]
        if not isinstance(v, list):
            return v
        out = []
        for item in v:
            if isinstance(item, str) and item.lstrip().startswith("{"):
                try:
                    item = json.loads(item)
                except json.JSONDecodeError as e:
                    raise ValueError(f"lora_modules entry {item!r} is not valid JSON: {e}") from None
            elif isinstance(item, str):
                name, sep, path = item.partition("=")
                if not sep or not name or not path:
                    raise ValueError(f"lora_modules entry {item!r} is not name=path")
                item = {"name": name, "path": path}
            out.append(item)
        return out

    @model_validator(mode="after")
    def _check(self) -> LoRAServingConfig:
        names = [m.name for m in self.lora_modules]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"lora_modules: the name {dup[0]!r} is given twice")
        if len(names) > self.max_loras:
            raise ValueError(f"lora_modules: {len(names)} adapters exceed max_loras {self.max_loras}")
        return self

    @property
    def enabled(self) -> bool:
        """LoRA serving is on (slots and hooks exist)."""
        return self.enable_lora or bool(self.lora_modules) or self.allow_runtime_lora_updating


class EngineConfig(Section):
    """KV-cache memory and batching of the serving engine (block manager and scheduler)."""

    block_size: int | None = Field(
        None, ge=1, description="Tokens per KV-cache block; None = 64 on CPU (decode attention runs one small "
        "matmul per block, so larger blocks amortise them), 16 on accelerators.")
    num_blocks: int | None = Field(None, ge=1, description="KV-cache blocks; None = kv_cache_bytes / bytes per block.")
    kv_cache_bytes: int = Field(512 << 20, ge=1, description="KV-cache memory when num_blocks is not given.")
    max_num_batched_tokens: int = Field(512, ge=1, description="SplitFuse token budget per forward pass.")
    max_num_seqs: int = Field(64, ge=1, description="Sequences per forward pass.")
    max_model_len: int | None = Field(
        None, ge=1, description="Cap on prompt + completion tokens; None = the model's context.")
    enable_prefix_caching: bool = Field(
        True, description="Reuse the KV blocks of a prompt prefix computed before (chained block hashes).")
    speculative_config: SpeculativeConfig | None = Field(
        None, description='Speculative decoding, as JSON: {"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4, "prompt_lookup_min": 1} or {"method": "draft_model", "model": "PATH", '
        '"num_speculative_tokens": 4}; None = off.')
    lora: LoRAServingConfig = Field(default_factory=LoRAServingConfig, description="Multi-LoRA serving.")
    gpu_memory_utilization: float = Field(
        0.9, gt=0, le=1, description="On CUDA, when neither num_blocks nor kv_cache_bytes is given: the fraction "
        "of the GPU's memory the engine may hold (weights, activations, and the KV cache in the rest), vLLM's "
        "flag; on CUDA max_num_batched_tokens and max_num_seqs left unset take vLLM's GPU defaults (8192, 256).")
    enforce_eager: bool = Field(
        False, description="Never capture CUDA graphs for decode steps nor torch.compile them (vLLM's flag); "
        "CPU never captures graphs.")
    async_scheduling: bool | None = Field(
        None, description="Overlap the host's work for the next step (scheduling, packing its inputs) with the "
        "device's current step, reading the decode rows' previous tokens on the device and emitting tokens one "
        "step behind (vLLM's flag); the same tokens either way. Steps fall back to synchronous while a request "
        "needs the host in the loop (logprobs, prompt_logprobs, penalties, structured outputs, n > 1, "
        "speculative decoding, tensor parallelism). None = on for CUDA, off on CPU.")
    compilation_config: int | None = Field(
        None, ge=0, le=3, description="vLLM's optimization level: 0 = eager model code; 1-3 = torch.compile of "
        "the decode step (one compiled shape per batch-size bucket, dynamic=False; under CUDA graphs where "
        "they run). None = 3 on CUDA, 0 on CPU (measured slower there than the fused CPU kernels).")

    @field_validator("speculative_config", mode="before")
    @classmethod
    def _json(cls, v: object) -> object:
        if isinstance(v, str):  # --speculative-config '{"method": "ngram", ...}'
            try:
                return json.loads(v)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        return v


class ServerLimits(Section):
    """Bounds on connections and on each HTTP request before it is queued."""

    max_body_bytes: int = Field(1 << 20, ge=1, description="Largest request body, in bytes (beyond: HTTP 413).")
    body_read_timeout_s: float = Field(
        30.0, gt=0, description="Seconds a client has to send its whole request body (beyond: HTTP 408 and "
        "the connection is closed).")
    header_read_timeout_s: float = Field(
        10.0, gt=0, description="Seconds a connection has to send a request's headers, from when it opens or "
        "its previous response ends (beyond: the connection is closed).")
    keep_alive_timeout_s: int = Field(
        5, ge=1, description="Seconds an idle keep-alive connection stays open (uvicorn's timeout_keep_alive).")
    max_connections: int = Field(
        512, ge=1, description="Most requests served at once, i.e. connections past their request headers "
        "(beyond: HTTP 503 in the OpenAI error shape); idle connections are bounded apart.")
    max_idle_connections: int = Field(
        256, ge=1, description="Most connections open that have not sent a complete request (new, or kept "
        "alive between requests); one more closes the oldest of them.")
    max_n: int = Field(16, ge=1, description="Largest 'n' (completions per prompt) a request may ask for.")
    max_prompts: int = Field(64, ge=1, description="Most prompts in one /v1/completions request.")
    max_request_seqs: int = Field(
        64, ge=1, description="Most sequences one request may ask for: its prompts times n (beyond: HTTP 400).")
    max_request_tokens: int = Field(
        262144, ge=1, description="Most tokens one request may ask for: the prompt tokens plus n times max_tokens, "
        "over its prompts (beyond: HTTP 400).")


class ServerConfig(Section):
    """The OpenAI-compatible HTTP server."""

    host: str = Field("127.0.0.1", description="Address to bind.")
    port: int = Field(8000, ge=0, le=65535, description="Port to bind.")
    api_key: str | None = Field(
        None, description="Require 'Authorization: Bearer KEY' on every route but /health; None = open.")
    served_model_name: str | None = Field(
        None, description="Model id reported by /v1/models; None = the model folder's name.")
    max_waiting: int = Field(256, ge=0, description="Bounded waiting queue; beyond it: HTTP 429.")
    log_level: str = Field("info", description="Log level of zeal and uvicorn (debug, info, warning, error).")
    limits: ServerLimits = Field(default_factory=ServerLimits, description="Per-request bounds.")
    disable_additional_properties: bool = Field(
        True, description="In JSON schemas of forced tool calls, response_format and structured_outputs, an "
        "object with 'properties' and no 'additionalProperties' takes no other keys (as if it said false), so "
        "the answer has the declared keys, each once; an explicit additionalProperties is kept. Off: JSON "
        "Schema's own default (any other key allowed).")
    engine_process: bool = Field(
        True, description="Run the engine in its own process beside the HTTP server (the GIL not shared); "
                          "off: an engine thread in the server's process. Tensor-parallel serving uses the thread.")


class InferenceConfig(Section):
    """Everything ``zeal serve`` takes: the model, the engine, the server, the process."""

    model: str | None = Field(
        None, description="HF folder (config.json + safetensors) or .gguf file; None = the embedded "
        "SmolLM2-135M-Instruct.")
    dtype: DType = Field(
        "auto", description="Weights and compute; auto: bfloat16 where the CPU/GPU computes it natively, "
        "else float32 (float16 on a GPU without bf16).")
    device: str = Field("cpu", description="torch device of the weights and the KV cache.")
    weights_offload: Literal["none", "cpu", "disk"] = Field(
        "none", description="ZeRO-Inference: stream the decoder layers each pass from layer files on disk, or "
        "from pinned host memory to an accelerator ('cpu'), under max_resident_weights_gb; none = all resident.")
    max_resident_weights_gb: float | None = Field(
        None, gt=0, description="Resident weight budget in GiB with weights_offload (the embeddings, norms and "
        "head, plus as many decoder-layer slots as fit; two or more overlap reading with compute).")
    weights_offload_quant: Literal["none", "int8", "int4"] = Field(
        "none", description="With weights_offload: store the streamed layers' weight matrices as int8 or int4 "
        "codes (symmetric, groups of 128 input weights, bf16 scales), dequantized on arrival; about 2x / 4x "
        "fewer bytes read per pass; none = the serving dtype.")
    quantized_matmul: Literal["off", "auto", "int8"] = Field(
        "off", description="auto (bf16) or int8 (bf16 and fp32): a compressed-tensors folder's int8 per-channel "
        "linears compute with int8 weight-only matmuls on CPU (torch._weight_int8pack_mm; 1 byte per weight "
        "resident, slower than the dequantized GEMM here); off: dequantized on load to the serving dtype.")
    offload_dir: str | None = Field(
        None, description="Folder of the layer files with weights_offload (written once per model and dtype); "
        "None = under zeal's cache.")
    tensor_parallel_size: int = Field(
        1, ge=1, description="Ranks the model is split over (Megatron column/row split of attention and MLP, "
        "each rank caching its own key/value heads); zeal serve starts the other ranks itself (or runs under "
        "torchrun); 1 = one process.")
    engine: EngineConfig = Field(default_factory=EngineConfig, description="KV cache and batching.")
    server: ServerConfig = Field(default_factory=ServerConfig, description="The HTTP server.")
    process: ProcessConfig = Field(
        default_factory=ProcessConfig, description="Process-wide settings (huge pages, CPU threads, malloc).")

    @field_validator("weights_offload", "weights_offload_quant", "quantized_matmul", mode="before")
    @classmethod
    def _choice(cls, v: object, info) -> object:
        choices = typing.get_args(cls.model_fields[info.field_name].annotation)
        if v not in choices:  # the choices named as LLM(...) and zeal serve have always named them
            raise ValueError(f"{info.field_name} must be one of {', '.join(choices)}, got {v!r}")
        return v

    @model_validator(mode="after")
    def _together(self) -> InferenceConfig:
        # the refusals of every way in (zeal serve, LLM, the engine process), written once
        check_weights_offload(self.weights_offload, self.max_resident_weights_gb, self.weights_offload_quant)
        tp = self.tensor_parallel_size
        if self.quantized_matmul != "off" and (tp != 1 or self.weights_offload != "none"):
            raise ValueError(f"quantized_matmul {self.quantized_matmul!r} serves a resident, unsplit model: not "
                             "with tensor_parallel_size > 1 or weights_offload")
        if self.weights_offload != "none" and tp != 1:
            raise ValueError(f"weights_offload {self.weights_offload!r} is not supported with "
                             f"tensor_parallel_size {tp}")
        return self
