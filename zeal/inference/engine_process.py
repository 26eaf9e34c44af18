"""The engine in its own process beside the HTTP server (the GIL no longer shared).

:class:`EngineProcess` has :class:`~zeal.inference.async_engine.AsyncEngine`'s surface
(``generate``, ``abort``, ``start``, ``shutdown``, ``num_waiting``, ``peak_waiting``,
``max_waiting``, ``engine``) so the server's handlers are the same for both. The child
(started with ``spawn``) loads the model and runs the :class:`LLMEngine` loop; the parent
keeps the tokenizer (for chat templates, token strings, tool parsing) and a view of the
engine's state. They speak length-prefixed JSON over one duplex pipe
(``send_bytes``/``recv_bytes``; nothing is pickled):

- parent → child: ``{"op": "add", "rid", "prompt", "params", "group", "lora"}``, ``{"op": "abort", "rid"}``,
  ``{"op": "lora", "token", "action": "load" | "unload", "name", "path"}``, ``{"op": "stop"}``;
- child → parent: ``{"op": "ready", "max_seq_tokens", "vocab_size"}`` once the model is
  loaded, or ``{"op": "fatal", "msg"}``; then after every step (and after commands that
  changed nothing else) ``{"op": "outs", "outs": [RequestOutput...], "errors": [...], "stats":
  {...}}`` — the stats (queue lengths, KV blocks, the metrics' counters) are applied before
  the outputs are delivered, so a client that has its answer sees the counters include it;
  ``"lora"`` lists the answers to LoRA commands: ``[token, error or null, status, result, adapters]``.

A request's failure in the child (a bad prompt, an engine error) reaches its stream as the
same exception type the thread engine raises. If the child dies, every open stream ends
with an error and new requests are refused with 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import logging
import multiprocessing as mp
import threading
import time
from multiprocessing.connection import Connection
from types import SimpleNamespace

from zeal.inference.async_engine import QueueFullError, StreamFront, _settle
from zeal.inference.lora_adapters import LoRAError, LoRANotFoundError
from zeal.inference.metrics import EngineMetrics
from zeal.inference.outputs import CompletionOutput, RequestOutput
from zeal.inference.sampling_params import SamplingParams
from zeal.inference.sleep import EngineAsleepError

log = logging.getLogger("zeal.serve")

ERROR_TYPES = {"value": ValueError, "asleep": EngineAsleepError, "engine": RuntimeError,
               "lora_not_found": LoRANotFoundError}


def _send(conn: Connection, msg: dict) -> None:
    conn.send_bytes(json.dumps(msg, separators=(",", ":")).encode())


def _recv(conn: Connection) -> dict:
    return json.loads(conn.recv_bytes())


def output_from_dict(d: dict) -> RequestOutput:
    """A :class:`RequestOutput` from its JSON form (top-logprob keys back to token ids)."""
    outs = []
    for c in d["outputs"]:
        if c.get("logprobs"):
            c["logprobs"] = [{**lp, "top_logprobs": {int(k): v for k, v in lp["top_logprobs"].items()}}
                             for lp in c["logprobs"]]
        outs.append(CompletionOutput(**c))
    if d.get("prompt_logprobs"):
        d["prompt_logprobs"] = [lp and {**lp, "top_logprobs": {int(k): v for k, v in lp["top_logprobs"].items()}}
                                for lp in d["prompt_logprobs"]]
    return RequestOutput(**{**d, "outputs": outs})


class MetricsView(EngineMetrics):
    """The parent's copy of the child's :class:`EngineMetrics`: counters loaded from each
    message; ``rejected_total`` counted here (the parent refuses requests)."""

    def __init__(self) -> None:
        super().__init__()
        self._tps = 0.0

    def load(self, snap: dict) -> None:
        with self.lock:
            for name, value in snap["counters"].items():
                setattr(self, name, value)
            self.requests_finished = dict(snap["finished"])
            for hist, (counts, total, count) in ((self.ttft, snap["ttft"]), (self.tpot, snap["tpot"])):
                hist.counts, hist.sum, hist.count = list(counts), total, count
            self._tps = snap["tps"]

    def tokens_per_second(self) -> float:
        return self._tps


def metrics_snapshot(m: EngineMetrics) -> dict:
    """What :meth:`MetricsView.load` reads."""
    tps = m.tokens_per_second()
    with m.lock:
        return {"counters": {n: getattr(m, n) for n in (
                    "prompt_tokens_total", "generation_tokens_total", "preemptions_total", "spec_drafts_total",
                    "spec_draft_tokens_total", "spec_accepted_tokens_total")},
                "finished": dict(m.requests_finished), "tps": tps,
                "ttft": [list(m.ttft.counts), m.ttft.sum, m.ttft.count],
                "tpot": [list(m.tpot.counts), m.tpot.sum, m.tpot.count]}


class EngineProcess(StreamFront):
    """An :class:`LLMEngine` built from ``cfg`` (an ``InferenceConfig``) in a child process,
    with the asyncio front of :class:`AsyncEngine`. Construction waits until the model is
    loaded (``startup_timeout`` seconds) and raises ``ValueError`` with the child's message
    if loading failed."""

    def __init__(self, cfg, tokenizer, max_waiting: int = 256, startup_timeout: float = 600.0) -> None:
        super().__init__()
        self.max_waiting = max_waiting
        self.tokenizer = tokenizer
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe(duplex=True)
        # unset fields stay unset in the child (on CUDA they take gpu_defaults' values there)
        self._proc = ctx.Process(target=child_main, args=(child, cfg.model_dump_json(exclude_unset=True)),
                                 name="zeal-engine", daemon=True)
        self._proc.start()
        child.close()
        if not self._conn.poll(startup_timeout):
            self._proc.kill()
            raise TimeoutError(f"the engine process did not load the model within {startup_timeout:.0f} s")
        try:
            hello = _recv(self._conn)
        except EOFError:
            raise RuntimeError(f"the engine process exited with {self._proc.exitcode} while loading") from None
        if hello["op"] == "fatal":
            self._proc.join(10)
            raise ValueError(hello["msg"])
        self.lora_config = cfg.engine.lora
        self._lora_cards: list[dict] = hello.get("loras", [])
        self._lora_waiting: dict[int, tuple] = {}  # token -> (loop, future) of a LoRA command
        self._lora_tokens = itertools.count()
        self.engine = SimpleNamespace(tokenizer=tokenizer, max_seq_tokens=hello["max_seq_tokens"],
                                      vocab_size=hello["vocab_size"], num_running=0, num_waiting=0,
                                      bm=SimpleNamespace(num_used_blocks=0, num_blocks=hello["num_blocks"]),
                                      metrics=MetricsView())
        self._send_lock = threading.Lock()
        self._adds_sent = self._adds_applied = 0
        self._dead: str | None = None
        self._reader: threading.Thread | None = None
        self.peak_waiting = 0

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self._reader is None:
            self._reader = threading.Thread(target=self._read_loop, name="zeal-engine-reader", daemon=True)
            self._reader.start()

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the child (requests in flight end with an error) and the reader."""
        try:
            self._post({"op": "stop"})
        except (OSError, ValueError):
            pass
        self._proc.join(timeout)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(timeout)
        if self._reader is not None:
            self._reader.join(timeout)
            self._reader = None
        self._conn.close()

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    @property
    def num_waiting(self) -> int:
        return self.engine.num_waiting + self._adds_sent - self._adds_applied

    # ------------------------------------------------------------ API (event loop side)
    def _post(self, msg: dict) -> None:
        with self._send_lock:
            _send(self._conn, msg)

    def _submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams, stream,
                group: str | None = None, lora_name: str | None = None) -> None:
        with self._lock:
            if self._dead is not None:
                raise RuntimeError(f"the engine process is not running: {self._dead}")
            if self.num_waiting >= self.max_waiting:
                self.engine.metrics.rejected_total += 1
                raise QueueFullError(f"the waiting queue is full ({self.max_waiting} requests); retry later")
            self._streams[request_id] = stream
            self._adds_sent += 1
            self.peak_waiting = max(self.peak_waiting, self.num_waiting)
            try:
                self._post({"op": "add", "rid": request_id, "prompt": list(prompt_ids),
                            "params": dataclasses.asdict(params), "group": group, "lora": lora_name})
            except (OSError, ValueError) as e:  # the pipe is closed: the child is gone
                self._streams.pop(request_id, None)
                raise RuntimeError(f"the engine process is not running ({type(e).__name__})") from None

    def abort(self, request_id: str) -> None:
        try:
            self._post({"op": "abort", "rid": request_id})
        except (OSError, ValueError):
            pass  # the child is gone: nothing to abort

    # ------------------------------------------------------------ LoRA adapters
    def lora_adapters(self) -> list[dict]:
        """``[{"name", "path", "rank"}]`` of the adapters the child serves (as of its last answer)."""
        return self._lora_cards

    async def load_lora_adapter(self, name: str, path: str) -> None:
        """Load a PEFT folder as ``name`` in the child (``LoRAError`` when refused)."""
        await self._lora_command("load", name, path)

    async def unload_lora_adapter(self, name: str) -> int:
        """Stop serving ``name``; returns how many of its requests are finishing with it."""
        return await self._lora_command("unload", name)

    async def _lora_command(self, action: str, name: str, path: str | None = None):
        if self._dead is not None:
            raise RuntimeError(f"the engine process is not running: {self._dead}")
        token = next(self._lora_tokens)
        fut = asyncio.get_running_loop().create_future()
        self._lora_waiting[token] = (asyncio.get_running_loop(), fut)
        try:
            self._post({"op": "lora", "token": token, "action": action, "name": name, "path": path})
        except (OSError, ValueError) as e:
            self._lora_waiting.pop(token, None)
            raise RuntimeError(f"the engine process is not running ({type(e).__name__})") from None
        return await fut

    def _lora_answers(self, answers: list) -> None:
        for token, error, status, result, cards in answers:
            self._lora_cards = cards
            loop, fut = self._lora_waiting.pop(token, (None, None))
            if fut is None:
                continue
            exc = None if error is None else LoRAError(status, error) if status else RuntimeError(error)
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                loop.call_soon_threadsafe(_settle, fut, result, exc)

    # ------------------------------------------------------------ reader thread
    def _apply_stats(self, stats: dict) -> None:
        e = self.engine
        with self._lock:
            e.num_running, e.num_waiting = stats["running"], stats["waiting"]
            e.bm.num_used_blocks = stats["used_blocks"]
            self._adds_applied = stats["adds"]
            self.peak_waiting = max(self.peak_waiting, self.num_waiting)
        e.metrics.load(stats["metrics"])

    def _read_loop(self) -> None:
        try:
            while True:
                msg = _recv(self._conn)
                if msg["op"] == "stopped":
                    break
                self._apply_stats(msg["stats"])
                for rid, kind, text in msg["errors"]:
                    self._deliver(rid, ERROR_TYPES[kind](text))
                for d in msg["outs"]:
                    self._deliver(d["request_id"], output_from_dict(d))
                self._lora_answers(msg.get("lora", []))
        except (EOFError, OSError) as e:
            self._dead = f"exited ({type(e).__name__}, exit code {self._proc.exitcode})"
            log.error("the engine process %s", self._dead)
        with self._lock:
            self._dead = self._dead or "stopped"
            open_streams = list(self._streams)
        for rid in open_streams:
            self._deliver(rid, RuntimeError(f"engine process {self._dead}"))
        self._lora_answers([(t, f"engine process {self._dead}", 0, None, self._lora_cards)
                            for t in list(self._lora_waiting)])


def child_main(conn: Connection, cfg_json: str) -> None:
    """The engine process: load the model from the config, say ready, run the loop."""
    from zeal.config.inference import InferenceConfig
    from zeal.inference.build import build_engine
    from zeal.utils.process import apply_process_settings

    cfg = InferenceConfig.model_validate_json(cfg_json)
    apply_process_settings(cfg.process)
    try:
        engine = build_engine(cfg)
    except Exception as e:  # noqa: BLE001 - reported to the parent, which exits with it
        _send(conn, {"op": "fatal", "msg": str(e) or type(e).__name__})
        return
    _send(conn, {"op": "ready", "max_seq_tokens": engine.max_seq_tokens, "vocab_size": engine.vocab_size,
                 "num_blocks": engine.bm.num_blocks, "loras": engine.loras.cards() if engine.loras else []})
    EngineLoop(engine, conn).run()


class EngineLoop:
    """The child's side: apply commands between steps, step, report."""

    def __init__(self, engine, conn: Connection) -> None:
        self.engine, self.conn = engine, conn
        self.adds = 0
        self.errors: list[tuple[str, str, str]] = []
        self.lora_answers: list[list] = []
        self.stop = False

    def _apply(self, msg: dict) -> None:
        op = msg["op"]
        if op == "add":
            self.adds += 1
            try:
                self.engine.add_request(msg["rid"], msg["prompt"], SamplingParams(**msg["params"]),
                                        group=msg.get("group"), lora_name=msg.get("lora"))
            except LoRANotFoundError as e:  # unloaded since the server checked the name
                self.errors.append((msg["rid"], "lora_not_found", str(e)))
            except ValueError as e:
                self.errors.append((msg["rid"], "value", str(e)))
            except EngineAsleepError as e:
                self.errors.append((msg["rid"], "asleep", str(e)))
            except Exception as e:  # noqa: BLE001 - a bug: fail this request, keep the loop
                log.exception("adding request %s failed", msg["rid"])
                self.engine.abort(msg["rid"])
                self.errors.append((msg["rid"], "engine", f"engine error: {type(e).__name__}: {e}"))
        elif op == "abort":
            self.engine.abort(msg["rid"])
        elif op == "lora":
            self._lora(msg)
        elif op == "stop":
            self.stop = True

    def _lora(self, msg: dict) -> None:
        """A LoRA command, answered in the next report."""
        error, status, result = None, 0, None
        try:
            if msg["action"] == "load":
                self.engine.load_lora_adapter(msg["name"], msg["path"])
            else:
                result = self.engine.unload_lora_adapter(msg["name"])
        except LoRAError as e:
            error, status = str(e), e.status
        except Exception as e:  # noqa: BLE001 - a bug: answered as a server error, the loop goes on
            log.exception("LoRA %s of %r failed", msg["action"], msg["name"])
            error = f"engine error: {type(e).__name__}: {e}"
        cards = self.engine.loras.cards() if self.engine.loras is not None else []
        self.lora_answers.append([msg["token"], error, status, result, cards])

    def _report(self, outs: list[RequestOutput]) -> None:
        e = self.engine
        stats = {"running": e.num_running, "waiting": e.num_waiting, "used_blocks": e.bm.num_used_blocks,
                 "adds": self.adds, "metrics": metrics_snapshot(e.metrics)}
        _send(self.conn, {"op": "outs", "outs": [dataclasses.asdict(o) for o in outs], "errors": self.errors,
                          "stats": stats, "lora": self.lora_answers})
        self.errors, self.lora_answers = [], []

    def _step(self) -> list[RequestOutput]:
        try:
            return self.engine.step()
        except Exception as e:  # noqa: BLE001 - outside any one request: fail those in flight, go on
            log.exception("engine step failed")
            for rid in list(self.engine.requests):
                self.engine.abort(rid)
                self.errors.append((rid, "engine", f"engine error: {e}"))
            time.sleep(0.01)
            return []

    def run(self) -> None:
        try:
            while not self.stop:
                busy = self.engine.has_unfinished()
                changed = False
                while self.conn.poll(0 if busy or changed else 0.05):
                    self._apply(_recv(self.conn))
                    changed = True
                if self.stop:
                    break
                outs = self._step() if self.engine.has_unfinished() else []
                if outs or changed or self.errors:
                    self._report(outs)
            for rid in list(self.engine.requests):
                self.engine.abort(rid)
            _send(self.conn, {"op": "stopped"})
        except (EOFError, OSError, BrokenPipeError):
            pass  # the server is gone: nothing to report to
