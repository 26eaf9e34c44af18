"""The HTTP side of multi-LoRA serving (vLLM's surface).

* a request's ``model`` names the base model or a served adapter (:func:`lora_of`);
* ``GET /v1/models`` lists each adapter after the base, with ``parent`` = the base's id
  and ``root`` = its folder (:func:`adapter_cards`);
* ``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path"}`` and ``POST
  /v1/unload_lora_adapter`` ``{"lora_name"}`` answer ``200`` with a one-line text (as
  vLLM), or an OpenAI error: 404 for an unknown name or a folder that does not exist,
  400 for a bad folder, a rank above ``max_lora_rank``, a name already loaded or all
  ``max_loras`` slots taken. They are served only when runtime updating is allowed
  (``--allow-runtime-lora-updating`` or vLLM's ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=true``);
  otherwise they answer 404 saying how to turn them on.

Unloading an adapter that requests are using lets them finish with it (new requests for
the name get 404 at once); see :mod:`zeal.inference.lora_adapters`.

The handlers take the server's ``AppState`` (its ``aengine`` exposes ``lora_adapters()``,
``load_lora_adapter`` and ``unload_lora_adapter``, in the engine thread or process).
"""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, ValidationError

from zeal.inference.lora_adapters import LoRAError, runtime_updating_allowed
from zeal.inference.protocol import APIError
from zeal.inference.server_guard import parse_json_object, read_body

__all__ = ["LoRAError", "LoadLoRAAdapterRequest", "api_error", "UnloadLoRAAdapterRequest", "adapter_cards", "load_lora_adapter", "lora_of",
           "unload_lora_adapter"]


class LoadLoRAAdapterRequest(BaseModel):
    """``POST /v1/load_lora_adapter``'s body."""

    model_config = ConfigDict(extra="forbid", strict=True)
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    """``POST /v1/unload_lora_adapter``'s body (``lora_int_id`` accepted for vLLM clients, unused)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    lora_name: str
    lora_int_id: int | None = None


def _adapters(state) -> list[dict]:
    fn = getattr(state.aengine, "lora_adapters", None)
    return fn() if fn is not None else []


def lora_of(state, model: str | None) -> str | None:
    """The adapter a request's ``model`` names (None: the base model). Call after the
    name was checked to be served."""
    if model is None or model == state.model_name:
        return None
    return model


def is_adapter(state, model: str | None) -> bool:
    """Whether ``model`` names a served adapter."""
    return model is not None and any(a["name"] == model for a in _adapters(state))


def adapter_cards(state) -> list[dict]:
    """The ``/v1/models`` entries of the served adapters (vLLM's: ``parent`` = the base model's id)."""
    return [{"id": a["name"], "object": "model", "created": state.created, "owned_by": "zeal", "root": a["path"],
             "parent": state.model_name, "max_model_len": state.engine.max_seq_tokens} for a in _adapters(state)]


def api_error(e: LoRAError) -> APIError:
    """The OpenAI error of a refused LoRA operation."""
    code = e.code or ("model_not_found" if e.status == 404 else None)
    return APIError(e.status, str(e), "invalid_request_error" if e.status < 500 else "server_error",
                    param=e.param, code=code)


async def _parse(state, request: Request, model: type[BaseModel]) -> BaseModel:
    cfg = getattr(state.aengine, "lora_config", None)
    if cfg is None or not runtime_updating_allowed(cfg):
        raise APIError(404, f"{request.url.path} is disabled: start zeal serve with --allow-runtime-lora-updating "
                       "(or VLLM_ALLOW_RUNTIME_LORA_UPDATING=true)", code="not_found")
    data = parse_json_object(await read_body(request, state.limits))
    try:
        return model.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(x) for x in first["loc"])
        raise APIError(400, f"{loc}: {first['msg']}", param=loc or None) from None


async def load_lora_adapter(state, request: Request) -> PlainTextResponse:
    """``POST /v1/load_lora_adapter``: serve a PEFT adapter folder under a new name."""
    req: LoadLoRAAdapterRequest = await _parse(state, request, LoadLoRAAdapterRequest)
    if req.lora_name == state.model_name:
        raise APIError(400, f"lora_name {req.lora_name!r} is the base model's name", param="lora_name")
    try:
        await state.aengine.load_lora_adapter(req.lora_name, req.lora_path)
    except LoRAError as e:
        raise api_error(e) from None
    except RuntimeError as e:  # the engine is gone
        raise APIError(503, str(e), "server_error") from None
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")


async def unload_lora_adapter(state, request: Request) -> PlainTextResponse:
    """``POST /v1/unload_lora_adapter``: stop serving an adapter (its running requests finish with it)."""
    req: UnloadLoRAAdapterRequest = await _parse(state, request, UnloadLoRAAdapterRequest)
    try:
        running = await state.aengine.unload_lora_adapter(req.lora_name)
    except LoRAError as e:
        raise api_error(e) from None
    except RuntimeError as e:
        raise APIError(503, str(e), "server_error") from None
    tail = f" ({running} running request(s) finish with it)" if running else ""
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.{tail}")
