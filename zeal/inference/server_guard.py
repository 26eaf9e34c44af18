"""What stands between a connection and the handlers: the API key, the body's size and
read time, JSON that Python can parse safely, and the OpenAI error answer.

Every refusal is an :class:`APIError` answered as ``{"error": {...}}`` with a 4xx
status. :class:`Guard` is plain ASGI (not Starlette's ``BaseHTTPMiddleware``, which
hides the client's disconnect from the handler behind it).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging

from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.requests import ClientDisconnect, Request
from starlette.types import ASGIApp, Receive, Scope, Send

from zeal.config.inference import ServerLimits
from zeal.inference.protocol import APIError

log = logging.getLogger("zeal.serve")


def error_response(e: APIError) -> JSONResponse:
    """The OpenAI error body; ``Connection: close`` when the request body was left unread."""
    return JSONResponse(e.body(), status_code=e.status, headers={"connection": "close"} if e.close else None)


def uvicorn_limits(limits: ServerLimits) -> dict:
    """The uvicorn settings that bound connections: idle connections (no complete request
    head yet) capped apart, oldest closed first, each with a deadline on its request head
    (:mod:`zeal.inference.conn_guard`), and idle keep-alive time. Requests being served are
    bounded by :class:`~zeal.inference.conn_guard.RequestLimit` in the app (JSON 503);
    uvicorn's ``limit_concurrency`` (plain-text 503, idle sockets counted) stays off."""
    from zeal.inference.conn_guard import guarded_protocol

    return {"http": guarded_protocol(limits.header_read_timeout_s, limits.max_idle_connections),
            "timeout_keep_alive": limits.keep_alive_timeout_s}


class Guard:
    """ASGI middleware: every route but ``/health`` needs the API key (when one is set,
    compared in constant time); a declared body over the size limit is refused unread."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.max_body_bytes = max_body_bytes

    def check(self, scope: Scope) -> APIError | None:
        """The refusal of this request, or None."""
        headers = Headers(scope=scope)
        if self.expected is not None and scope["path"] != "/health":
            given = headers.get("authorization", "").encode("latin-1")
            if not hmac.compare_digest(given, self.expected):
                return APIError(401, "invalid or missing API key", "authentication_error", code="invalid_api_key")
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
            return APIError(413, f"request body larger than {self.max_body_bytes} bytes", close=True)
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and (err := self.check(scope)) is not None:
            await error_response(err)(scope, receive, send)
            return
        await self.app(scope, receive, send)


async def read_body(request: Request, limits: ServerLimits) -> bytes:
    """The whole body, within ``max_body_bytes`` (413) and ``body_read_timeout_s`` (408).
    A client that leaves mid-upload is logged in one line (499, answered to nobody)."""
    limit, timeout = limits.max_body_bytes, limits.body_read_timeout_s

    async def read() -> bytes:
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise APIError(413, f"request body larger than {limit} bytes", close=True)
        return bytes(body)

    try:
        return await asyncio.wait_for(read(), timeout)
    except asyncio.TimeoutError:
        raise APIError(408, f"request body not received within {timeout} s", code="request_timeout",
                       close=True) from None
    except ClientDisconnect:
        client = request.client
        log.info("client %s went away while sending its request body", f"{client.host}:{client.port}"
                 if client else "?")
        raise APIError(499, "client disconnected while sending the request body", close=True) from None


def _no_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def parse_json_object(body: bytes) -> dict:
    """``body`` as a JSON object, or a 400 naming what is wrong: invalid JSON (NaN and
    Infinity included), nesting deeper than Python's recursion limit, an integer longer
    than Python converts (4300 digits), a string holding a lone surrogate escape."""
    try:
        data = json.loads(body, parse_constant=_no_constant)
        # a lone surrogate ("\ud800") parses but is no Unicode text: the tokenizer cannot take it
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except RecursionError:
        raise APIError(400, "request body is nested too deeply") from None
    except UnicodeError as e:
        raise APIError(400, f"request body is not valid UTF-8 / Unicode text: {e.reason}") from None
    except ValueError as e:  # JSONDecodeError, and the integer-size limit
        raise APIError(400, f"request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise APIError(400, "request body must be a JSON object")
    return data


def check_budget(limits: ServerLimits, prompt_lens: list[int], n: int, max_tokens: int) -> None:
    """400 naming the limit when a request asks for more sequences (prompts x ``n``) or more
    tokens (prompt tokens + ``n`` x ``max_tokens``, over its prompts) than one request may."""
    seqs = len(prompt_lens) * n
    if seqs > limits.max_request_seqs:
        raise APIError(400, f"this request asks for {seqs} sequences ({len(prompt_lens)} prompt(s) x n {n}); one "
                            f"request may ask for {limits.max_request_seqs} (max_request_seqs, --max-request-seqs)",
                       param="n", code="request_too_large")
    tokens = sum(prompt_lens) + seqs * max_tokens
    if tokens > limits.max_request_tokens:
        raise APIError(400, f"this request asks for {tokens} tokens (prompt tokens + n x max_tokens per prompt); one "
                            f"request may ask for {limits.max_request_tokens} (max_request_tokens, "
                            "--max-request-tokens)", param="max_tokens", code="request_too_large")
