"""OpenAI-compatible HTTP server (FastAPI): completions, chat completions, models, health, metrics.

Every request is validated before it reaches the engine; anything wrong is
answered with an OpenAI-style ``{"error": {...}}`` and a 4xx status (400 bad
input, 401 bad key, 404 unknown route or model, 408 body too slow, 413 body too
large, 429 queue full; 503 only when the engine is down or failed the request).
Streaming uses server-sent events; a client that goes away, streaming or not,
aborts its request, which frees its KV blocks.

Each endpoint is a module-level function taking the :class:`AppState` and the
request; :func:`build_app` only wires them to routes.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from zeal.config.inference import ServerLimits
from zeal.inference import lora_routes
from zeal.inference.async_engine import AsyncEngine, QueueFullError
from zeal.inference.chat_choices import chat_chunks, chat_logprobs, chat_message, usage_of
from zeal.inference.completion_choices import CompletionChoices
from zeal.inference.conn_guard import RequestLimit
from zeal.inference.engine import LLMEngine
from zeal.inference.outputs import RequestOutput
from zeal.inference.protocol import APIError, ChatCompletionRequest, CompletionRequest
from zeal.inference.sampling_params import SamplingParams
from zeal.inference.server_guard import (
    Guard,
    check_budget,
    error_response,
    parse_json_object,
    read_body,
    uvicorn_limits,
)
from zeal.inference.structured import StructuredOutputsParams, close_objects
from zeal.inference.tools import allowed_tools, call_schema, forced

__all__ = ["AppState", "ServerLimits", "build_app", "uvicorn_limits"]

log = logging.getLogger("zeal.serve")

Outputs = AsyncIterator[tuple[int, RequestOutput]]  # (prompt index, output) as the engine makes progress


@dataclass
class AppState:
    """What the handlers share: the engine behind its queue, the served name and the bounds."""

    aengine: AsyncEngine
    model_name: str
    api_key: str | None = None
    limits: ServerLimits = field(default_factory=ServerLimits)
    created: int = field(default_factory=lambda: int(time.time()))
    disable_additional_properties: bool = True  # objects of JSON schemas closed unless they say otherwise

    @property
    def engine(self) -> LLMEngine:
        return self.aengine.engine

    def token_bytes(self, t: int) -> list[int] | None:
        """One token's bytes (None without a tokenizer)."""
        tok = self.engine.tokenizer
        return tok.token_bytes(t) if tok is not None else None

    def token_str(self, t: int) -> str:
        """One token as text, special tokens included (ids as text without a tokenizer)."""
        tok = self.engine.tokenizer
        return tok.decode([t], skip_special_tokens=False) if tok is not None else str(t)


def build_app(aengine: AsyncEngine, model_name: str, api_key: str | None = None,
              limits: ServerLimits | None = None, disable_additional_properties: bool = True) -> FastAPI:
    """The FastAPI application over a started or startable :class:`AsyncEngine`.
    ``disable_additional_properties``: see ``ServerConfig`` (JSON schemas' objects closed)."""
    state = AppState(aengine, model_name, api_key, limits or ServerLimits(),
                     disable_additional_properties=disable_additional_properties)
    app = FastAPI(title="zeal", docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=functools.partial(_lifespan, state))
    app.add_middleware(Guard, api_key=api_key, max_body_bytes=state.limits.max_body_bytes)
    app.add_middleware(RequestLimit, max_requests=state.limits.max_connections)  # outermost: counts every request
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(Exception, _internal_error)
    for path, method, handler in ROUTES:
        app.add_api_route(path, _bind(state, handler), methods=[method])
    app.openapi = functools.partial(openapi_schema, app)
    return app


def openapi_schema(app: FastAPI) -> dict:
    """The app's OpenAPI schema with the request bodies the handlers parse themselves
    (not served: for clients and for the schema-driven tests)."""
    if app.openapi_schema is None:
        from fastapi.openapi.utils import get_openapi

        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for path, model in BODIES.items():
            js = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(js.pop("$defs", {}))
            components[model.__name__] = js
            ref = {"$ref": f"#/components/schemas/{model.__name__}"}
            schema["paths"][path]["post"]["requestBody"] = {"required": True,
                                                            "content": {"application/json": {"schema": ref}}}
        app.openapi_schema = schema
    return app.openapi_schema


def _bind(state: AppState, handler: Callable[[AppState, Request], Awaitable[object]]):
    async def endpoint(request: Request):
        return await handler(state, request)

    endpoint.__name__ = handler.__name__
    return endpoint


@contextlib.asynccontextmanager
async def _lifespan(state: AppState, _app: FastAPI):
    state.aengine.start()
    try:
        yield
    finally:  # Ctrl-C: requests in flight are cancelled, the engine thread stops
        state.aengine.shutdown()


# ------------------------------------------------------------ errors and guards
async def _http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
    return error_response(APIError(exc.status_code, str(exc.detail), "invalid_request_error"))


async def _api_error(_request: Request, exc: APIError) -> JSONResponse:
    return error_response(exc)


async def _internal_error(_request: Request, exc: Exception) -> JSONResponse:
    # a bug: still an OpenAI error body (Starlette logs the traceback)
    return error_response(APIError(500, f"internal error: {type(exc).__name__}", "server_error"))


def engine_error(e: BaseException) -> APIError:
    """The OpenAI error for an exception raised while a request ran."""
    if isinstance(e, QueueFullError):
        return APIError(429, str(e), "rate_limit_error", code="queue_full")
    if isinstance(e, APIError):
        return e
    if isinstance(e, lora_routes.LoRAError):  # e.g. the adapter was unloaded while the request was queued
        return lora_routes.api_error(e)
    if isinstance(e, ValueError):
        return APIError(400, str(e))
    return APIError(503, str(e), "server_error")


def output_error(out: RequestOutput) -> APIError:
    """The OpenAI error for a request the engine ended with an error."""
    if out.error_type == "server_error":
        return APIError(503, out.error or "engine error", "server_error")
    return APIError(400, out.error or "invalid request")


def _validation_message(e: ValidationError) -> tuple[str, str | None]:
    first = e.errors()[0]
    loc = ".".join(str(x) for x in first["loc"])
    return f"{loc}: {first['msg']}", loc or None


# ------------------------------------------------------------ request checks
async def parse_body(state: AppState, request: Request, model: type[BaseModel]) -> BaseModel:
    """The body as ``model``, read within the size and time limits; names the first bad field."""
    data = parse_json_object(await read_body(request, state.limits))
    try:
        req = model.model_validate(data)
    except ValidationError as e:
        msg, param = _validation_message(e)
        raise APIError(400, msg, param=param) from None
    if req.model not in (None, state.model_name) and not lora_routes.is_adapter(state, req.model):
        raise APIError(404, f"model {req.model!r} does not exist (serving {state.model_name!r})",
                       code="model_not_found")
    if req.n > state.limits.max_n:
        raise APIError(400, f"n must be <= {state.limits.max_n}, got {req.n}", param="n")
    return req


def check_length(engine: LLMEngine, prompt_ids: list[int], max_tokens: int | None, default: int | None) -> int:
    """The completion length to ask for; 400 when the prompt is bad or the total too long."""
    limit = engine.max_seq_tokens
    if not prompt_ids:
        raise APIError(400, "prompt is empty", param="prompt")
    if max(prompt_ids) >= engine.vocab_size or min(prompt_ids) < 0:
        raise APIError(400, f"prompt token ids must be in [0, {engine.vocab_size})", param="prompt")
    if max_tokens is None:
        max_tokens = max(1, limit - len(prompt_ids)) if default is None else default
        max_tokens = min(max_tokens, max(1, limit - len(prompt_ids)))
    if len(prompt_ids) + max_tokens > limit:
        raise APIError(400, f"this model's maximum context length is {limit} tokens; the request has "
                            f"{len(prompt_ids)} prompt tokens and asks for {max_tokens} completion tokens",
                       param="max_tokens", code="context_length_exceeded")
    return max_tokens


def _sampling(state: AppState, req: CompletionRequest | ChatCompletionRequest, max_tokens: int,
              logprobs: int | None) -> SamplingParams:
    try:
        params = req.sampling_params(max_tokens, logprobs)
    except ValueError as e:
        raise APIError(400, str(e)) from None
    so = params.structured_outputs
    if state.disable_additional_properties and so is not None and isinstance(so.json, dict):
        so.json = close_objects(so.json)
    return params


def _tier(req: CompletionRequest | ChatCompletionRequest) -> dict:
    """``service_tier`` of the answer: echoed (as ``default``) when the request named one."""
    return {"service_tier": "default"} if req.service_tier is not None else {}


# ------------------------------------------------------------ running requests
async def run_all(aengine: AsyncEngine, prompts: list[list[int]], params: SamplingParams,
                  lora_name: str | None = None) -> Outputs:
    """Run one engine request per prompt (with the LoRA adapter ``lora_name``, None: the
    base model); yield ``(prompt_index, output)`` as they come."""
    rids = [f"{uuid.uuid4().hex}" for _ in prompts]
    group = rids[0]  # one client request: the scheduler shares its passes fairly with the others
    gens = [aengine.generate(rid, p, params, group, lora_name) for rid, p in zip(rids, prompts)]
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, g) -> None:
        try:
            async for out in g:
                if out.error:
                    raise output_error(out)
                await q.put((i, out))
        except BaseException as e:  # noqa: BLE001 - forwarded to the consumer
            await q.put((i, e))
        finally:
            await q.put((i, None))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    open_ = len(prompts)
    try:
        while open_:
            i, item = await q.get()
            if item is None:
                open_ -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for g in gens:
            await g.aclose()


async def wait_disconnect(request: Request) -> None:
    """Return when the client has gone (the body already read, ``receive`` only has that left to say)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def collect(agen: Outputs, request: Request) -> dict[int, RequestOutput]:
    """Gather final outputs; abort everything as soon as the client goes away."""
    final: dict[int, RequestOutput] = {}

    async def drain() -> None:
        async for i, out in agen:
            if out.finished:
                final[i] = out

    task = asyncio.ensure_future(drain())
    watch = asyncio.ensure_future(wait_disconnect(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:  # cancelling drain() closes the engine streams, which aborts their requests
        watch.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, watch, return_exceptions=True)
    if task.cancelled():
        log.info("client went away: request aborted")
        raise APIError(499, "client disconnected")
    task.result()
    return final


async def collect_or_error(agen: Outputs, request: Request) -> dict[int, RequestOutput]:
    """:func:`collect`, with any failure answered as an OpenAI error."""
    try:
        return await collect(agen, request)
    except BaseException as e:
        raise engine_error(e) from None


def sse(obj) -> str:
    """One server-sent event."""
    return f"data: {json.dumps(obj)}\n\n"


async def stream_response(agen: Outputs, make_chunks: Callable[[int, RequestOutput], Iterator[dict]]) -> Response:
    """Server-sent events of ``make_chunks(i, output)``, then ``[DONE]``."""
    # pull the first output before answering 200, so a full queue is still a 429
    try:
        first = await agen.__anext__()
    except StopAsyncIteration:
        first = None
    except BaseException as e:
        await agen.aclose()
        raise engine_error(e) from None

    async def body():
        try:
            if first is not None:
                for c in make_chunks(*first):
                    yield sse(c)
            async for i, out in agen:
                for c in make_chunks(i, out):
                    yield sse(c)
        except BaseException as e:  # noqa: BLE001
            if isinstance(e, asyncio.CancelledError | GeneratorExit):
                raise
            yield sse(engine_error(e).body())
        finally:
            await agen.aclose()
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream")


# ------------------------------------------------------------ endpoints
async def health(state: AppState, request: Request) -> dict:
    """``GET /health``: the process is up (no key needed)."""
    return {"status": "ok"}


def _model_card(state: AppState) -> dict:
    return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "zeal",
            "max_model_len": state.engine.max_seq_tokens}


async def models(state: AppState, request: Request) -> dict:
    """``GET /v1/models``: the model served, then its LoRA adapters."""
    return {"object": "list", "data": [_model_card(state), *lora_routes.adapter_cards(state)]}


async def model(state: AppState, request: Request) -> dict:
    """``GET /v1/models/{model}``: the served model's card (the SDK's ``models.retrieve``); 404 for another."""
    name = request.path_params["model"]
    card = next((c for c in lora_routes.adapter_cards(state) if c["id"] == name), None)
    if card is not None:
        return card
    if name != state.model_name:
        raise APIError(404, f"model {name!r} does not exist (serving {state.model_name!r})", param="model",
                       code="model_not_found")
    return _model_card(state)


async def metrics(state: AppState, request: Request) -> PlainTextResponse:
    """``GET /metrics``: Prometheus text (queue, batch, KV usage, latencies, throughput)."""
    aengine, engine = state.aengine, state.engine
    bm = engine.bm
    gauges = {
        "zeal_num_requests_waiting": (aengine.num_waiting, "Requests waiting to be scheduled."),
        "zeal_num_requests_waiting_peak": (aengine.peak_waiting, "Most requests ever waiting at once."),
        "zeal_num_requests_waiting_limit": (aengine.max_waiting, "Bound on waiting requests (beyond: 429)."),
        "zeal_num_requests_running": (engine.num_running, "Sequences in the running batch."),
        "zeal_kv_blocks_used": (bm.num_used_blocks, "KV-cache blocks in use."),
        "zeal_kv_blocks_total": (bm.num_blocks, "KV-cache blocks in all."),
        "zeal_kv_cache_usage_ratio": (bm.num_used_blocks / bm.num_blocks, "Fraction of KV blocks in use."),
        "zeal_generation_tokens_per_second": (engine.metrics.tokens_per_second(),
                                              "Generated tokens per second over the last 10 s."),
        "zeal_spec_decode_draft_acceptance_rate": (engine.metrics.spec_acceptance_rate(),
                                                   "Speculative draft tokens accepted / proposed (0: none yet)."),
    }
    return PlainTextResponse(engine.metrics.render(gauges), media_type="text/plain; version=0.0.4")


def _completion_prompts(state: AppState, req: CompletionRequest) -> tuple[list, list[list[int]]]:
    """``(prompts as sent, their token ids)``: one text, one id list, or a list of either."""
    p = req.prompt
    if isinstance(p, str) or (p and all(isinstance(x, int) for x in p)):
        prompts_in = [p]
    else:
        prompts_in = list(p)
    if not prompts_in or len(prompts_in) > state.limits.max_prompts:
        raise APIError(400, f"prompt must hold 1 to {state.limits.max_prompts} prompts", param="prompt")
    tok = state.engine.tokenizer
    if any(isinstance(x, str) for x in prompts_in) and tok is None:
        raise APIError(400, "this model has no tokenizer: send token ids", param="prompt")
    return prompts_in, [tok.encode(x) if isinstance(x, str) else list(x) for x in prompts_in]


async def completions(state: AppState, request: Request) -> Response | dict:
    """``POST /v1/completions``: one or more prompts, ``n`` choices each, streamed or not.
    ``echo`` with ``logprobs`` scores the prompt tokens too (``max_tokens: 0``: only them)."""
    req: CompletionRequest = await parse_body(state, request, CompletionRequest)
    if req.suffix is not None:
        raise APIError(400, "suffix is not supported", param="suffix")
    if req.max_tokens == 0 and not req.echo:
        raise APIError(400, "max_tokens must be >= 1 (0 only with echo: the prompt is scored, nothing generated)",
                       param="max_tokens")
    echo_only = req.max_tokens == 0
    prompts_in, prompts = _completion_prompts(state, req)
    max_tokens = min(check_length(state.engine, x, 1 if echo_only else req.max_tokens, 16) for x in prompts)
    check_budget(state.limits, [len(x) for x in prompts], req.n, max_tokens)
    params = _sampling(state, req, max_tokens, req.logprobs)
    if req.echo and req.logprobs is not None:
        params.prompt_logprobs = req.logprobs
    lora = lora_routes.lora_of(state, req.model)
    cid, name = f"cmpl-{uuid.uuid4().hex}", lora or state.model_name
    made = CompletionChoices(state.engine.tokenizer, state.token_str, req, prompts_in, prompts, echo_only)
    agen = run_all(state.aengine, prompts, params, lora)
    ptoks = sum(len(x) for x in prompts)

    def usage() -> dict:
        ct = made.num_completion_tokens
        return {"prompt_tokens": ptoks, "completion_tokens": ct, "total_tokens": ptoks + ct}

    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        done: set[int] = set()

        def chunks(i: int, out: RequestOutput) -> Iterator[dict]:
            base = {"id": cid, "object": "text_completion", "created": int(time.time()), "model": name}
            for choice in made.deltas(i, out):
                yield base | {"choices": [choice]} | ({"usage": None} if include_usage else {})
            if out.finished:
                done.add(i)
                if include_usage and len(done) == len(prompts):
                    yield base | {"choices": [], "usage": usage()}

        return await stream_response(agen, chunks)
    final = await collect_or_error(agen, request)
    choices = [ch for i in range(len(prompts)) for ch in made.whole(i, final[i])]
    return {"id": cid, "object": "text_completion", "created": int(time.time()), "model": name,
            "choices": choices, "usage": usage()}


async def chat_completions(state: AppState, request: Request) -> Response | dict:
    """``POST /v1/chat/completions``: one conversation through the model's chat template."""
    req: ChatCompletionRequest = await parse_body(state, request, ChatCompletionRequest)
    tok = state.engine.tokenizer
    if tok is None:
        raise APIError(400, "this model has no tokenizer: chat is unavailable")
    msgs = [m.template_dict() for m in req.messages]
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    choice = req.tool_choice.model_dump() if isinstance(req.tool_choice, BaseModel) else req.tool_choice
    if choice not in (None, "none", "auto") and not tools:
        raise APIError(400, "tool_choice needs tools", param="tool_choice")
    try:
        prompt = tok.encode_chat(msgs, tools=tools)
    except Exception as e:  # template errors (e.g. unsupported roles) are the caller's
        raise APIError(400, f"chat template failed: {e}", param="messages") from None
    max_tokens = check_length(state.engine, prompt, req.max_completion_tokens or req.max_tokens, None)
    check_budget(state.limits, [len(prompt)], req.n, max_tokens)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    params = _sampling(state, req, max_tokens, (req.top_logprobs or 0) if req.logprobs else None)
    funcs = _tool_functions(state, tools, choice, params)
    lora = lora_routes.lora_of(state, req.model)
    cid, name = f"chatcmpl-{uuid.uuid4().hex}", lora or state.model_name
    agen = run_all(state.aengine, [prompt], params, lora)
    if req.stream:
        usage = bool(req.stream_options and req.stream_options.include_usage)
        return await stream_response(agen, chat_chunks(state, cid, name, len(prompt), usage, funcs, forced(choice),
                                                         req.parallel_tool_calls, _tier(req)))
    final = (await collect_or_error(agen, request))[0]
    choices = []
    for c in final.outputs:
        msg, reason = chat_message(c, funcs, req.parallel_tool_calls)
        choices.append({"index": c.index, "message": msg, "logprobs": chat_logprobs(state, c),
                        "finish_reason": reason})
    return {"id": cid, "object": "chat.completion", "created": int(time.time()), "model": name,
            "choices": choices, "usage": usage_of(len(prompt), final)} | _tier(req)


def _tool_functions(state: AppState, tools: list[dict] | None, choice: str | dict | None,
                    params: SamplingParams) -> list[dict] | None:
    """The functions a call may name (None: no tool calls); a forced choice constrains ``params``
    to a call of them."""
    if not tools or choice == "none":
        return None
    try:
        funcs = allowed_tools(tools, choice)
    except ValueError as e:
        raise APIError(400, str(e), param="tool_choice") from None
    if forced(choice):
        if params.structured_outputs is not None:
            raise APIError(400, "a forced tool_choice cannot be combined with response_format", param="tool_choice")
        try:
            schema = call_schema(funcs)
            params.structured_outputs = StructuredOutputsParams(
                json=close_objects(schema) if state.disable_additional_properties else schema)
        except ValueError as e:
            raise APIError(400, f"tools: {e}", param="tools") from None
    return funcs


BODIES: dict[str, type[BaseModel]] = {"/v1/completions": CompletionRequest,
                                      "/v1/chat/completions": ChatCompletionRequest}

ROUTES: list[tuple[str, str, Callable[[AppState, Request], Awaitable[object]]]] = [
    ("/health", "GET", health),
    ("/v1/models", "GET", models),
    ("/v1/models/{model:path}", "GET", model),
    ("/metrics", "GET", metrics),
    ("/v1/completions", "POST", completions),
    ("/v1/chat/completions", "POST", chat_completions),
    ("/v1/load_lora_adapter", "POST", lora_routes.load_lora_adapter),
    ("/v1/unload_lora_adapter", "POST", lora_routes.unload_lora_adapter),
]
