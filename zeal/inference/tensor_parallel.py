"""Tensor-parallel serving (DeepSpeed-Inference's split; vLLM's ``tensor_parallel_size``).

The model is split over ``T`` ranks by the training split rules of
:func:`zeal.parallel.tensor.apply_tensor_parallel` (one place knows which linears split
how): q/k/v and gate/up (or fc) by columns, o and down (or proj) by rows, grouped
key/value heads whole per rank; the row-parallel outputs are summed over the ranks by
one all-reduce per split pair. Embeddings, norms and the LM head stay whole on every
rank, so every rank computes the full-vocabulary logits of the rows it samples.

Rank 0 owns the scheduler, the tokenizer, the sampler and (for ``zeal serve``) the HTTP
server. Each forward pass is flattened into a :class:`~zeal.inference.model_runner.StepPlan`
(token ids, positions, cache slots, block tables: plain integers) that rank 0 broadcasts
as JSON over the tensor-parallel group (a length header, then the bytes; never pickle);
ranks 1..T-1 run :meth:`TensorParallelGroup.serve`, a loop that runs each plan on their
shard. Each rank's KV cache holds only its own key/value heads (1/T of the memory).

Two ways to get the ranks:

* launched (``torchrun`` or any job that sets ``RANK``/``WORLD_SIZE``, or an initialised
  process group): every rank builds its ``LLM``; rank 0's serves, the others' constructors
  run the worker loop until rank 0 calls ``shutdown()`` (or exits);
* started by zeal (``zeal serve PATH --tensor-parallel-size T``, ``LLM(PATH,
  tensor_parallel_size=T)`` in a plain process): rank 0 is this process and starts one
  ``python -m zeal.inference.tp_worker`` subprocess per other rank, with torchrun's
  variables, and stops them on exit. A rank that dies is reported by rank, and
  ``zeal serve`` then exits (``LLM`` raises it at the next pass; one that dies before
  joining the group leaves ``LLM`` waiting until the process group's timeout).

The fused CPU kernels take their head counts from the tensors they get, so they run on
the local heads unchanged. Not under tensor parallelism: ``load_weights``, ``sleep``
and ``weights_offload`` (refused by name).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from zeal.inference.model_runner import ModelRunner, StepPlan

__all__ = ["GroupFailedError", "TensorParallelGroup", "check_tp_size", "in_launched_job", "join_tensor_parallel", "load_split",
           "spawn_tensor_parallel"]

STOP, INIT, STEP, ALIVE = 0, 1, 2, 3  # the commands rank 0 sends


class GroupFailedError(RuntimeError):
    """A tensor-parallel pass could not run (a rank died, a collective failed): the ranks'
    collectives are out of step, so the group serves no more. Every request in flight fails
    with this one-line message (no per-request retry, no collective's traceback)."""


def in_launched_job() -> bool:
    """Whether this process is one rank of a launched job (a process group exists, or
    torchrun's ``WORLD_SIZE`` > 1 says one is to be joined)."""
    return dist.is_initialized() or int(os.environ.get("WORLD_SIZE", "1")) > 1


def check_tp_size(model: nn.Module, size: int) -> None:
    """Raise ValueError naming the count when ``size`` cannot split ``model`` (a zeal GPT or
    Llama): larger than its attention heads, or not dividing its attention heads,
    key/value heads or MLP width."""
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {size!r}")
    cfg = model.config
    heads = getattr(cfg, "num_attention_heads", None) or cfg.n_head
    width = getattr(cfg, "intermediate_size", None) or 4 * cfg.n_embd
    if size > heads:
        raise ValueError(f"tensor_parallel_size {size} is larger than the model's {heads} attention heads")
    for n, what in ((heads, "attention heads"), (model.num_kv_heads, "key/value heads"), (width, "MLP width")):
        if n % size:
            raise ValueError(f"tensor_parallel_size {size} does not divide the model's {n} {what}")


class _Channel:
    """Rank 0 to the other ranks of the tp group: a command and a byte payload (JSON),
    each a broadcast over the accounted tp Comm (kind ``control``)."""

    def __init__(self, comm) -> None:
        self.comm = comm
        self.device = comm.ctx.device  # NCCL broadcasts device tensors

    def send(self, cmd: int, payload: bytes = b"") -> None:
        self.comm.broadcast(torch.tensor([cmd, len(payload)], dtype=torch.int64, device=self.device), 0, "control")
        if payload:
            buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self.device)
            self.comm.broadcast(buf, 0, "control")

    def recv(self) -> tuple[int, bytes]:
        head = torch.empty(2, dtype=torch.int64, device=self.device)
        self.comm.broadcast(head, 0, "control")
        cmd, n = head.tolist()
        if not n:
            return cmd, b""
        buf = torch.empty(n, dtype=torch.uint8, device=self.device)
        self.comm.broadcast(buf, 0, "control")
        return cmd, buf.cpu().numpy().tobytes()


class TensorParallelGroup:
    """This rank's place in a tensor-parallel serving group (see the module docstring).

    ``procs``: the worker subprocesses rank 0 started (none when launched); a watchdog
    thread reports the first that exits, by rank, through ``on_death(message)`` (None:
    the message is kept and the next pass raises it). ``owns_group``: the process group
    was started here and is destroyed by :meth:`shutdown`."""

    def __init__(self, mesh, procs: list[subprocess.Popen] | None = None, owns_group: bool = False,
                 on_death: Callable[[str], None] | None = None) -> None:
        self.mesh = mesh
        self.size, self.rank = mesh.tp_size, mesh.tp_rank
        self.channel = _Channel(mesh.tp)
        self.procs = list(procs or [])
        self.owns_group = owns_group
        self.on_death = on_death
        self.dead: str | None = None
        self._closed = False
        self._lock = threading.Lock()  # one pass (or heartbeat) at a time: collectives stay in order
        self._last_send = time.monotonic()
        if self.procs:
            threading.Thread(target=self._watch, name="zeal-tp-watchdog", daemon=True).start()
        if self.is_driver:
            atexit.register(self.shutdown)

    @property
    def is_driver(self) -> bool:
        """Rank 0: the one with the scheduler."""
        return self.rank == 0

    @property
    def closed(self) -> bool:
        """Whether :meth:`shutdown` ran."""
        return self._closed

    def shard(self, model: nn.Module) -> nn.Module:
        """Split ``model`` in place over the group (the training split rules); returns it."""
        from zeal.moe.tensor import moe_tensor_parallel
        from zeal.parallel.tensor import apply_tensor_parallel

        check_tp_size(model, self.size)
        apply_tensor_parallel(model, self.size, self.mesh, (moe_tensor_parallel,))
        return model

    # -- rank 0 ------------------------------------------------------------------------------
    def attach(self, runner: ModelRunner) -> None:
        """Rank 0: tell the other ranks the cache's shape, then send them every pass of ``runner``."""
        spec = {"num_blocks": runner.num_blocks, "block_size": runner.block_size,
                "kv_dtype": str(runner.kv_dtype).removeprefix("torch.")}
        with self._lock:
            self._send(INIT, json.dumps(spec).encode())
        runner.tp_driver = self
        threading.Thread(target=self._heartbeat, name="zeal-tp-heartbeat", daemon=True).start()

    def _send(self, cmd: int, payload: bytes = b"") -> None:
        self.channel.send(cmd, payload)
        self._last_send = time.monotonic()

    @contextlib.contextmanager
    def pass_of(self, plan: StepPlan) -> Iterator[None]:
        """Rank 0: send ``plan`` to the other ranks and hold the group while this rank runs it."""
        with self._lock:
            if self.dead is not None:
                raise GroupFailedError(self.dead)
            if self._closed:
                raise RuntimeError("the tensor-parallel group was shut down")
            try:
                self._send(STEP, plan.to_json())
                yield
            except Exception as e:  # noqa: BLE001 - any failure mid-pass leaves the ranks out of step
                self.dead = self.dead or self._failure(e)
                raise GroupFailedError(self.dead) from None

    def _failure(self, e: BaseException, wait: float = 2.0) -> str:
        """One line for a failed pass: the rank that died (a started worker seen exiting within
        ``wait`` seconds: a collective fails as soon as a peer's socket closes), else the error."""
        deadline = time.monotonic() + (wait if self.procs else 0)
        while True:
            for r, p in enumerate(self.procs, start=1):
                if p.poll() is not None:
                    return f"tensor-parallel rank {r} exited with code {p.returncode}"
            if time.monotonic() >= deadline:
                first = (str(e).strip().splitlines() or [""])[0][:200]
                return f"a tensor-parallel pass failed ({type(e).__name__}: {first})"
            time.sleep(0.05)

    def _heartbeat(self) -> None:
        """Idle ranks wait in a broadcast, which fails after the process group's timeout: while
        no pass runs, rank 0 sends a no-op well within it."""
        from zeal.dist.forensics import comm_timeout_s

        every = min(60.0, comm_timeout_s(None) / 4)
        while not self._closed:
            time.sleep(min(1.0, every / 4))
            if time.monotonic() - self._last_send > every and self._lock.acquire(blocking=False):
                try:
                    if not self._closed and self.dead is None:
                        self._send(ALIVE)
                except Exception:  # noqa: BLE001 - a dead rank: the watchdog or the next pass reports it
                    return
                finally:
                    self._lock.release()

    # -- ranks 1..T-1 --------------------------------------------------------------------------
    def serve(self, model: nn.Module) -> int:
        """Ranks 1..T-1: build this rank's runner as rank 0 says and run every pass it sends,
        until it stops the group. Returns the number of passes run."""
        cmd, data = self.channel.recv()
        if cmd == STOP:
            return 0
        if cmd != INIT:
            raise RuntimeError(f"tensor-parallel rank {self.rank}: expected the cache's shape, got command {cmd}")
        spec = json.loads(data)
        runner = ModelRunner(model, spec["num_blocks"], spec["block_size"], getattr(torch, spec["kv_dtype"]),
                             tp_size=self.size)
        passes = 0
        while True:
            cmd, data = self.channel.recv()
            if cmd == STOP:
                return passes
            if cmd == STEP:
                runner.run(StepPlan.from_json(data))
                passes += 1

    # -- lifetime ------------------------------------------------------------------------------
    def _watch(self) -> None:
        while not self._closed:
            for r, p in enumerate(self.procs, start=1):
                code = p.poll()
                if code is not None and not self._closed:
                    self.dead = f"tensor-parallel rank {r} exited with code {code}"
                    if self.on_death is not None:
                        self.on_death(self.dead)
                    return
            time.sleep(0.2)

    def kill_workers(self) -> None:
        """End the worker subprocesses now (they are this process's own children)."""
        for p in self.procs:
            if p.poll() is None:
                p.kill()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Rank 0: stop the other ranks (their loops return), wait for the subprocesses it
        started, and destroy the process group it started. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.is_driver and self.dead is None:
            if self._lock.acquire(timeout=timeout):  # not while a pass is stuck
                try:
                    self._send(STOP)
                except Exception:  # noqa: BLE001 - a rank already gone: the processes are ended below
                    pass
                finally:
                    self._lock.release()
        deadline = time.monotonic() + timeout
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()


def join_tensor_parallel(size: int) -> TensorParallelGroup:
    """Join a launched job (torchrun's variables, or a process group already started) as
    one rank of a tensor-parallel group spanning the whole job."""
    from zeal.dist.context import init_distributed
    from zeal.dist.mesh import build_mesh

    ctx = init_distributed()
    if ctx.world_size != size:
        raise ValueError(f"tensor_parallel_size {size} != the world size {ctx.world_size} of this job "
                         f"(launch {size} ranks, or none and let zeal start them)")
    return TensorParallelGroup(build_mesh(ctx, tp=size))


def spawn_tensor_parallel(size: int, spec: dict, on_death: Callable[[str], None] | None = None
                          ) -> TensorParallelGroup:
    """Rank 0 of a new group: start ranks 1..size-1 as ``python -m zeal.inference.tp_worker
    SPEC`` (``spec``: the JSON-able ``model`` folder, ``dtype`` name and ``device``) with
    torchrun's variables, and join them. The CPU threads are shared out between the ranks."""
    from zeal.dist.context import init_distributed
    from zeal.dist.forensics import comm_timeout_s
    from zeal.dist.launch import free_port, rank_env
    from zeal.dist.mesh import build_mesh

    timeout = datetime.timedelta(seconds=comm_timeout_s(None))
    port = free_port()
    threads = max(1, torch.get_num_threads() // size)
    procs = []
    for r in range(1, size):
        env = {**os.environ, **rank_env(r, size, port, threads=threads)}
        procs.append(subprocess.Popen([sys.executable, "-m", "zeal.inference.tp_worker", json.dumps(spec)], env=env))
    torch.set_num_threads(threads)
    joined = threading.Event()
    if on_death is not None:  # a rank that dies before joining would leave this one waiting
        threading.Thread(target=_watch_startup, args=(procs, joined, on_death), daemon=True).start()
    try:
        backend = "nccl" if torch.cuda.is_available() and str(spec.get("device", "cpu")).startswith("cuda") else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=size,
                                timeout=timeout)
        mesh = build_mesh(init_distributed(), tp=size)
    except BaseException:
        joined.set()
        for p in procs:
            p.kill()
        if dist.is_initialized():
            dist.destroy_process_group()
        raise
    joined.set()
    return TensorParallelGroup(mesh, procs, owns_group=True, on_death=on_death)


def _watch_startup(procs: list[subprocess.Popen], joined: threading.Event, on_death: Callable[[str], None]) -> None:
    while not joined.wait(0.2):
        for r, p in enumerate(procs, start=1):
            if p.poll() is not None and not joined.is_set():
                on_death(f"tensor-parallel rank {r} exited with code {p.returncode} before joining")
                return


def load_split(path, size: int, dtype: torch.dtype, device: str,
               on_death: Callable[[str], None] | None = None) -> tuple[nn.Module, object, list[int], TensorParallelGroup]:
    """Load the model folder ``path`` (None: the default model) on every rank of a
    tensor-parallel group of ``size`` and split it: ``(model, tokenizer, eos ids, group)``.
    In a launched job every rank calls this; otherwise this process becomes rank 0 and
    starts the others (after checking that ``size`` splits the model)."""
    from zeal.inference.loader import load_model_and_tokenizer, resolve_model_path

    p = resolve_model_path(path)
    if in_launched_job():
        tp = join_tensor_parallel(size)
        dev = tp.mesh.device if str(device).startswith("cuda") else device
        model, tok, eos = load_model_and_tokenizer(p, dtype, dev)
    else:
        model, tok, eos = load_model_and_tokenizer(p, dtype, device)
        check_tp_size(model, size)
        spec = {"model": str(p), "dtype": str(dtype).removeprefix("torch."), "device": str(device)}
        tp = spawn_tensor_parallel(size, spec, on_death)
    try:
        tp.shard(model)
    except BaseException:
        tp.shutdown()
        raise
    return model, tok, eos, tp
