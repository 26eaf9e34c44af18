"""OpenAI-compatible HTTP server (FastAPI): completions, chat completions, models, health, metrics.

Every request is validated before it reaches the engine; anything wrong is
answered with an OpenAI-style ``{"error": {...}}`` and a 4xx status (400 bad
input, 401 bad key, 404 unknown route or model, 413 body too large, 429 queue
full). Streaming uses server-sent events; a client that goes away aborts its
request, which frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from zeal.inference.async_engine import AsyncEngine, QueueFullError
from zeal.inference.outputs import RequestOutput
from zeal.inference.protocol import APIError, ChatCompletionRequest, CompletionRequest


@dataclass
class ServerLimits:
    """Bounds applied to requests before they are queued."""

    max_body_bytes: int = 1 << 20
    max_n: int = 16
    max_prompts: int = 64


def _err(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def _validation_message(e: ValidationError) -> tuple[str, str | None]:
    first = e.errors()[0]
    loc = ".".join(str(x) for x in first["loc"])
    return f"{loc}: {first['msg']}", loc or None


def build_app(aengine: AsyncEngine, model_name: str, api_key: str | None = None,
              limits: ServerLimits | None = None) -> FastAPI:
    """The FastAPI application over a started or startable :class:`AsyncEngine`."""
    limits = limits or ServerLimits()
    engine = aengine.engine
    tok = engine.tokenizer
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        aengine.start()
        try:
            yield
        finally:  # Ctrl-C: requests in flight are cancelled, the engine thread stops
            aengine.shutdown()

    app = FastAPI(title="zeal", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)

    @app.middleware("http")
    async def _guard(request: Request, call_next):
        if api_key and request.url.path != "/health":
            if request.headers.get("authorization", "") != f"Bearer {api_key}":
                return _err(APIError(401, "invalid or missing API key", "authentication_error", code="invalid_api_key"))
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > limits.max_body_bytes):
            return _err(APIError(413, f"request body larger than {limits.max_body_bytes} bytes"))
        return await call_next(request)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, exc: StarletteHTTPException):
        return _err(APIError(exc.status_code, str(exc.detail), "invalid_request_error"))

    @app.exception_handler(APIError)
    async def _api_error(_request: Request, exc: APIError):
        return _err(exc)

    async def parse(request: Request, model: type[BaseModel]) -> BaseModel:
        body = b""
        async for chunk in request.stream():
            body += chunk
            if len(body) > limits.max_body_bytes:
                raise APIError(413, f"request body larger than {limits.max_body_bytes} bytes")
        try:
            data = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"request body is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise APIError(400, "request body must be a JSON object")
        try:
            req = model.model_validate(data)
        except ValidationError as e:
            msg, param = _validation_message(e)
            raise APIError(400, msg, param=param) from None
        if req.model not in (None, model_name):
            raise APIError(404, f"model {req.model!r} does not exist (serving {model_name!r})", code="model_not_found")
        if req.n > limits.max_n:
            raise APIError(400, f"n must be <= {limits.max_n}, got {req.n}", param="n")
        return req

    def check_length(prompt_ids: list[int], max_tokens: int | None, default: int | None) -> int:
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

    def token_str(t: int) -> str:
        return tok.decode([t], skip_special_tokens=False) if tok is not None else str(t)

    async def run_all(prompts: list[list[int]], params, request: Request) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Run one engine request per prompt; yield ``(prompt_index, output)`` as they come."""
        rids = [f"{uuid.uuid4().hex}" for _ in prompts]
        gens = [aengine.generate(rid, p, params) for rid, p in zip(rids, prompts)]
        q: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, g) -> None:
            try:
                async for out in g:
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

    async def collect(agen: AsyncIterator[tuple[int, RequestOutput]], request: Request) -> dict[int, RequestOutput]:
        """Gather final outputs; abort everything if the client goes away meanwhile."""
        final: dict[int, RequestOutput] = {}

        async def drain() -> None:
            async for i, out in agen:
                if out.error:
                    raise APIError(400, out.error)
                if out.finished:
                    final[i] = out

        task = asyncio.ensure_future(drain())
        while not task.done():
            await asyncio.wait({task}, timeout=0.25)
            if not task.done() and await request.is_disconnected():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                raise APIError(499, "client disconnected")
        task.result()
        return final

    def engine_error(e: BaseException) -> APIError:
        if isinstance(e, QueueFullError):
            return APIError(429, str(e), "rate_limit_error", code="queue_full")
        if isinstance(e, APIError):
            return e
        if isinstance(e, ValueError):
            return APIError(400, str(e))
        return APIError(503, str(e), "server_error")

    def sse(obj) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    async def stream_response(agen, make_chunks, request: Request) -> Response:
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

    # ------------------------------------------------------------ routes
    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                           "owned_by": "zeal", "max_model_len": engine.max_seq_tokens}]}

    @app.get("/metrics")
    async def metrics():
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
        }
        return PlainTextResponse(engine.metrics.render(gauges), media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(request: Request):
        req: CompletionRequest = await parse(request, CompletionRequest)
        p = req.prompt
        if isinstance(p, str):
            prompts_in = [p]
        elif p and all(isinstance(x, int) for x in p):
            prompts_in = [p]
        else:
            prompts_in = list(p)
        if not prompts_in or len(prompts_in) > limits.max_prompts:
            raise APIError(400, f"prompt must hold 1 to {limits.max_prompts} prompts", param="prompt")
        if any(isinstance(x, str) for x in prompts_in) and tok is None:
            raise APIError(400, "this model has no tokenizer: send token ids", param="prompt")
        prompts = [tok.encode(x) if isinstance(x, str) else list(x) for x in prompts_in]
        max_tokens = min(check_length(x, req.max_tokens, 16) for x in prompts)
        try:
            params = req.sampling_params(max_tokens, req.logprobs)
        except ValueError as e:
            raise APIError(400, str(e)) from None
        cid, n = f"cmpl-{uuid.uuid4().hex}", req.n
        agen = run_all(prompts, params, request)

        def logprobs_obj(c) -> dict | None:
            if c.logprobs is None:
                return None
            return {"tokens": [token_str(x["token"]) for x in c.logprobs],
                    "token_logprobs": [x["logprob"] for x in c.logprobs],
                    "top_logprobs": [{token_str(t): v for t, v in x["top_logprobs"].items()} for x in c.logprobs],
                    "text_offset": []}

        if req.stream:
            def chunks(i: int, out: RequestOutput):
                for c in out.outputs:
                    if c.delta_text or c.finish_reason or c.delta_token_ids:
                        yield {"id": cid, "object": "text_completion", "created": int(time.time()),
                               "model": model_name, "choices": [{"index": i * n + c.index, "text": c.delta_text,
                                                                 "logprobs": None, "finish_reason": c.finish_reason}]}

            return await stream_response(agen, chunks, request)
        try:
            final = await collect(agen, request)
        except BaseException as e:
            raise engine_error(e) from None
        choices, ctoks = [], 0
        for i in range(len(prompts)):
            for c in final[i].outputs:
                ctoks += len(c.token_ids)
                choices.append({"index": i * n + c.index, "text": (prompts_in[i] if req.echo and isinstance(
                    prompts_in[i], str) else "") + c.text, "logprobs": logprobs_obj(c), "finish_reason": c.finish_reason})
        ptoks = sum(len(x) for x in prompts)
        return {"id": cid, "object": "text_completion", "created": int(time.time()), "model": model_name,
                "choices": choices, "usage": {"prompt_tokens": ptoks, "completion_tokens": ctoks,
                                              "total_tokens": ptoks + ctoks}}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req: ChatCompletionRequest = await parse(request, ChatCompletionRequest)
        if tok is None:
            raise APIError(400, "this model has no tokenizer: chat is unavailable")
        msgs = [{"role": m.role, "content": m.text()} for m in req.messages]
        try:
            prompt = tok.encode_chat(msgs)
        except Exception as e:  # template errors (e.g. unsupported roles) are the caller's
            raise APIError(400, f"chat template failed: {e}", param="messages") from None
        max_tokens = check_length(prompt, req.max_completion_tokens or req.max_tokens, None)
        try:
            params = req.sampling_params(max_tokens, (req.top_logprobs or 0) if req.logprobs else None)
        except ValueError as e:
            raise APIError(400, str(e)) from None
        cid = f"chatcmpl-{uuid.uuid4().hex}"
        agen = run_all([prompt], params, request)

        def lp_obj(c) -> dict | None:
            if c.logprobs is None:
                return None
            return {"content": [{"token": token_str(x["token"]), "logprob": x["logprob"], "bytes": None,
                                 "top_logprobs": [{"token": token_str(t), "logprob": v, "bytes": None}
                                                  for t, v in x["top_logprobs"].items()]} for x in c.logprobs]}

        if req.stream:
            started: set[int] = set()
            usage = bool(req.stream_options and req.stream_options.include_usage)

            def chunks(_i: int, out: RequestOutput):
                base = {"id": cid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model_name}
                for c in out.outputs:
                    delta = {}
                    if c.index not in started:
                        started.add(c.index)
                        delta["role"] = "assistant"
                    if c.delta_text:
                        delta["content"] = c.delta_text
                    if delta or c.finish_reason:
                        yield base | {"choices": [{"index": c.index, "delta": delta, "logprobs": None,
                                                   "finish_reason": c.finish_reason}]}
                if usage and out.finished:
                    ct = sum(len(c.token_ids) for c in out.outputs)
                    yield base | {"choices": [], "usage": {"prompt_tokens": len(prompt), "completion_tokens": ct,
                                                           "total_tokens": len(prompt) + ct}}

            return await stream_response(agen, chunks, request)
        try:
            final = (await collect(agen, request))[0]
        except BaseException as e:
            raise engine_error(e) from None
        ct = sum(len(c.token_ids) for c in final.outputs)
        return {"id": cid, "object": "chat.completion", "created": int(time.time()), "model": model_name,
                "choices": [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                             "logprobs": lp_obj(c), "finish_reason": c.finish_reason} for c in final.outputs],
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": ct, "total_tokens": len(prompt) + ct}}

    return app
