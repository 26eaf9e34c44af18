"""The engine in a background thread, spoken to through queues (for the HTTP server).

Commands (add, abort) go into a thread-safe inbox; the engine thread applies
them between steps, so the engine itself is only ever touched by one thread.
Outputs go back to the event loop of the caller through ``call_soon_threadsafe``
into one ``asyncio.Queue`` per request.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator

from zeal.inference.engine import LLMEngine
from zeal.inference.outputs import RequestOutput
from zeal.inference.sampling_params import SamplingParams
from zeal.inference.sleep import EngineAsleepError
from zeal.inference.tensor_parallel import GroupFailedError

log = logging.getLogger("zeal.serve")


def _settle(fut: asyncio.Future, result, error: BaseException | None) -> None:
    if not fut.done():
        fut.set_exception(error) if error is not None else fut.set_result(result)


class QueueFullError(RuntimeError):
    """The bounded waiting queue is full (the server answers 429)."""


class StreamFront(abc.ABC):
    """The asyncio side both engine hosts share: one ``asyncio.Queue`` per request, filled
    from the host's own thread by :meth:`_deliver`. Subclasses admit a request in
    :meth:`_submit` (registering its stream under ``self._lock``) and cancel one in
    :meth:`abort`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}

    @abc.abstractmethod
    def _submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                stream: tuple[asyncio.AbstractEventLoop, asyncio.Queue], group: str | None = None,
                lora_name: str | None = None) -> None:
        """Admit a request and register ``stream`` for it (raise to refuse it); ``group``: the
        client request it is part of (the engine shares its passes fairly between groups);
        ``lora_name``: the LoRA adapter it runs with (None: the base model)."""

    @abc.abstractmethod
    def abort(self, request_id: str) -> None:
        """Cancel a request (a no-op when it has finished)."""

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                       group: str | None = None, lora_name: str | None = None) -> AsyncIterator[RequestOutput]:
        """Stream the outputs of one request; closing the iterator early aborts it. ``group``:
        the client request it is part of (default: its own id); ``lora_name``: the LoRA
        adapter to run it with (None: the base model)."""
        q: asyncio.Queue = asyncio.Queue()
        self._submit(request_id, prompt_ids, params, (asyncio.get_running_loop(), q), group, lora_name)
        finished = False
        try:
            while True:
                out = await q.get()
                if isinstance(out, BaseException):
                    finished = True
                    raise out
                yield out
                if out.finished:
                    finished = True
                    return
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def _deliver(self, request_id: str, item) -> None:
        """Hand ``item`` (an output or an exception) to the request's stream, if still open."""
        with self._lock:
            target = self._streams.get(request_id)
        if target is not None:
            loop, q = target
            try:
                loop.call_soon_threadsafe(q.put_nowait, item)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                self.abort(request_id)


class AsyncEngine(StreamFront):
    """Thread-hosted :class:`LLMEngine` with an asyncio front.

    ``max_waiting`` bounds requests accepted but not yet admitted to the running
    batch; beyond it :meth:`generate` raises :class:`QueueFullError` at once.
    """

    def __init__(self, engine: LLMEngine, max_waiting: int = 256) -> None:
        super().__init__()
        self.engine = engine
        self.max_waiting = max_waiting
        self._inbox: queue.Queue = queue.Queue()
        self._pending_adds = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.steps = 0
        self.peak_waiting = 0  # high-water mark of num_waiting (exported on /metrics)
        self.dead: str | None = None  # why the engine can run no more requests (a tensor-parallel rank died)

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="zeal-engine", daemon=True)
            self._thread.start()

    def shutdown(self, timeout: float = 5.0) -> None:
        """Cancel what is in flight and stop the thread."""
        self._stop.set()
        self._inbox.put(("wake",))
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    @property
    def num_waiting(self) -> int:
        return self.engine.num_waiting + self._pending_adds

    # ------------------------------------------------------------ API (event loop side)
    def _submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams, stream,
                group: str | None = None, lora_name: str | None = None) -> None:
        with self._lock:
            if self.dead is not None:
                raise RuntimeError(f"the engine cannot run requests: {self.dead}")
            if self.num_waiting >= self.max_waiting:
                self.engine.metrics.rejected_total += 1
                raise QueueFullError(f"the waiting queue is full ({self.max_waiting} requests); retry later")
            self._pending_adds += 1
            self._streams[request_id] = stream
            self.peak_waiting = max(self.peak_waiting, self.num_waiting)
        self._inbox.put(("add", request_id, prompt_ids, params, group, lora_name))

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def fail_all(self, message: str) -> None:
        """The engine can run no more (any thread): every open stream ends with ``message``
        (an error event, then ``[DONE]``) and new requests are refused (503)."""
        with self._lock:
            self.dead = self.dead or message
            rids = list(self._streams)
        for rid in rids:
            self._deliver(rid, RuntimeError(message))
            self.abort(rid)

    # ------------------------------------------------------------ engine thread
    def _apply(self, cmd: tuple) -> None:
        if cmd[0] == "add":
            _, rid, prompt_ids, params, group, lora_name = cmd
            # the move from pending to the engine's waiting queue happens under the lock, so
            # that generate() never sees the request in neither place and admits one too many
            error = None
            with self._lock:
                self._pending_adds -= 1
                if rid not in self._streams:
                    return  # aborted before it reached the engine
                try:
                    self.engine.add_request(rid, prompt_ids, params, group=group, lora_name=lora_name)
                except (ValueError, EngineAsleepError) as e:  # the request's own failure (400 / 503)
                    error = e
                except Exception as e:  # noqa: BLE001 - a bug: fail this request, keep the thread
                    log.exception("adding request %s failed", rid)
                    self.engine.abort(rid)
                    error = RuntimeError(f"engine error: {type(e).__name__}: {e}")
            if error is not None:
                self._deliver(rid, error)
        elif cmd[0] == "abort":
            self.engine.abort(cmd[1])
        elif cmd[0] == "call":  # run_in_engine: a function of the engine, on this thread, between steps
            _, fn, loop, fut = cmd
            try:
                result, error = fn(self.engine), None
            except Exception as e:  # noqa: BLE001 - handed to the caller
                result, error = None, e
            with contextlib.suppress(RuntimeError):  # the caller's loop is closed: nobody waits
                loop.call_soon_threadsafe(_settle, fut, result, error)

    async def run_in_engine(self, fn):
        """``fn(engine)`` on the engine thread between two steps; its result (or exception)."""
        if self._thread is None or self.dead is not None:
            return fn(self.engine)  # no thread to race with (or none left)
        fut = asyncio.get_running_loop().create_future()
        self._inbox.put(("call", fn, asyncio.get_running_loop(), fut))
        return await fut

    # ------------------------------------------------------------ LoRA adapters (the server's view)
    @property
    def lora_config(self):
        """The engine's ``LoRAServingConfig``."""
        return self.engine.config.lora

    def lora_adapters(self) -> list[dict]:
        """``[{"name", "path", "rank"}]`` of the adapters served (empty without LoRA)."""
        loras = self.engine.loras
        return loras.cards() if loras is not None else []

    async def load_lora_adapter(self, name: str, path: str) -> None:
        """Load a PEFT folder as ``name`` (``LoRAError`` with its HTTP status when refused)."""
        await self.run_in_engine(lambda e: e.load_lora_adapter(name, path))

    async def unload_lora_adapter(self, name: str) -> int:
        """Stop serving ``name``; returns how many of its requests are finishing with it."""
        return await self.run_in_engine(lambda e: e.unload_lora_adapter(name))

    def _loop(self) -> None:
        while not self._stop.is_set():
            idle = not self.engine.has_unfinished()
            try:
                cmd = self._inbox.get(timeout=0.05) if idle else self._inbox.get_nowait()
                self._apply(cmd)
                while True:
                    self._apply(self._inbox.get_nowait())
            except queue.Empty:
                pass
            if self._stop.is_set() or not self.engine.has_unfinished():
                continue
            try:
                outs = self.engine.step()
                self.steps += 1
                self.peak_waiting = max(self.peak_waiting, self.num_waiting)  # preemption re-queues
            except GroupFailedError as e:  # one line: the collective's traceback says nothing more
                log.error("%s: failing the %d request(s) in flight; no more can run", e, len(self.engine.requests))
                for rid in list(self.engine.requests):
                    self.engine.abort(rid)
                self.fail_all(str(e))
                continue
            except Exception as e:  # noqa: BLE001 - outside any one request (the engine isolates its
                # requests' own failures): a bug must not kill the server, fail the requests in flight
                log.exception("engine step failed")
                for rid in list(self.engine.requests):
                    self.engine.abort(rid)
                    self._deliver(rid, RuntimeError(f"engine error: {e}"))
                time.sleep(0.01)
                continue
            for out in outs:
                self._deliver(out.request_id, out)
        for rid in list(self.engine.requests):  # shutting down: cancel the rest
            self.engine.abort(rid)
            self._deliver(rid, RuntimeError("server is shutting down"))
