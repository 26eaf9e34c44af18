"""OpenAI request bodies (the fields zeal reads) and the OpenAI error shape.

Types are strict where OpenAI's are: ``"10"`` or ``true`` is not an integer, ``1``
is not a boolean (an integer is a number, as in JSON Schema).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from zeal.inference.sampling_params import SamplingParams
from zeal.inference.structured import StructuredOutputsParams


class APIError(Exception):
    """An error answered as ``{"error": {...}}`` with an HTTP status."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, close: bool = False) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.close = close  # answer with "Connection: close" (the body was not read to its end)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema``: the schema the output must match."""

    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)
    name: str = "response"
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: plain text, any JSON object, or a JSON schema."""

    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


def structured_params(fmt: ResponseFormat | None, extra: dict | None) -> StructuredOutputsParams | None:
    """The constraint of a request: its ``response_format`` or vLLM's ``structured_outputs``
    extension (``{"json" | "regex" | "grammar" | "json_object": ...}``), at most one of them."""
    if fmt is not None and fmt.type != "text" and extra is not None:
        raise ValueError("give response_format or structured_outputs, not both")
    if extra is not None:
        unknown = sorted(set(extra) - {"json", "json_object", "regex", "grammar"})
        if unknown:
            raise ValueError(f"structured_outputs: unknown keys {', '.join(unknown)} "
                             "(one of json, json_object, regex, grammar)")
        return StructuredOutputsParams(**extra)
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise ValueError("response_format of type json_schema needs json_schema.schema")
    return StructuredOutputsParams(json=fmt.json_schema.schema_)


class _Sampling(BaseModel):
    """Sampling fields shared by both endpoints (OpenAI names plus common extensions)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1)
    stream: bool = False
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)  # OpenAI: a 64-bit signed integer
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    # extensions (vLLM-style)
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: dict | None = None  # vLLM's extension: json, json_object, regex or grammar
    logit_bias: dict[str, float] | None = None  # refused unless empty: not applied by the sampler
    user: str | None = None  # an end-user id (OpenAI: for abuse monitoring); accepted, not used
    service_tier: str | None = None  # "auto" / "default" only: zeal serves every request at one tier

    @field_validator("service_tier")
    @classmethod
    def _one_tier(cls, v: str | None) -> str | None:
        if v not in (None, "auto", "default"):
            raise ValueError(f"service_tier {v!r} is not offered: zeal serves every request at one tier "
                             "(send auto or default, or omit it)")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v:
            raise ValueError("logit_bias is not supported by zeal serve (omit it, or send {})")
        return v

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            n=self.n, max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            min_p=self.min_p, repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, seed=self.seed, stop=stop,
            stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos, logprobs=logprobs,
            structured_outputs=structured_params(self.response_format, self.structured_outputs),
        )


class CompletionRequest(_Sampling):
    """``POST /v1/completions``. ``max_tokens: 0`` is accepted with ``echo`` (the prompt is
    scored, nothing generated: what evaluation harnesses send); ``suffix`` is refused."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(None, ge=0)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    stream_options: StreamOptions | None = None


class TextPart(BaseModel):
    """One part of a message's content (only text parts are served)."""

    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """A chat message. As in OpenAI's API, ``content`` is required except on an assistant
    message that carries ``tool_calls`` (or the older ``function_call``), where it may be
    null: that message is rendered with empty content and its tool calls passed to the
    chat template."""

    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[dict] | None = None
    function_call: dict | None = None

    @model_validator(mode="after")
    def _content_required(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and (self.tool_calls or self.function_call)):
            raise ValueError("content is required (it may be null only on an assistant message with tool_calls)")
        return self

    def template_dict(self) -> dict:
        """The message as the chat template sees it."""
        d = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            d["tool_calls"] = self.tool_calls
        return d

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class StreamOptions(BaseModel):
    """``stream_options`` of a streamed request (both routes)."""

    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False


class FunctionSpec(BaseModel):
    """A tool's ``function``: its name, description and JSON schema of arguments."""

    model_config = ConfigDict(extra="ignore", strict=True)
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict | None = None


class ToolSpec(BaseModel):
    """One entry of ``tools``."""

    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["function"]
    function: FunctionSpec


class ToolChoiceFunction(BaseModel):
    """``tool_choice.function``: the name of the function the answer must call."""

    model_config = ConfigDict(extra="ignore", strict=True)
    name: str


class NamedToolChoice(BaseModel):
    """``tool_choice`` naming one function: ``{"type": "function", "function": {"name": ...}}``."""

    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["function"]
    function: ToolChoiceFunction


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True  # false: an answer carries at most one tool call

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    stream_options: StreamOptions | None = None

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice_shape(cls, v: object) -> object:
        named = (isinstance(v, dict) and v.get("type") == "function" and isinstance(v.get("function"), dict)
                 and isinstance(v["function"].get("name"), str))
        if v is None or named or v in ("none", "auto", "required"):
            return v
        raise ValueError('must be "none", "auto", "required" or {"type": "function", "function": {"name": NAME}}')
