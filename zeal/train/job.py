"""A training job's loop (``run_job``); what the job is (``JobSpec``) lives in :mod:`zeal.config.job`.

``run_job`` runs on every rank (all ranks call it; rank 0 alone prints and writes
metrics). It evaluates held-out loss before, periodically and after training,
saves checkpoints with ``engine.save_checkpoint`` (client state: the step, token
count and elapsed time, so ``resume`` continues the same schedule and the same
batches), prints a generated sample, and leaves in the run folder:
``config.json``, ``tokenizer.json``, ``metrics.jsonl``, ``metrics.csv``,
``loss.png``, ``summary.json`` and ``checkpoints/``.
"""

from __future__ import annotations

import json
import math
import os
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from zeal.config.job import (  # noqa: F401 - read_spec re-exported
    SMOLLM2_NAMES,
    JobSpec,
    read_spec,
    resolve_auto,
    resolve_precision,
    write_spec,
)
from zeal.dist.comm import Comm
from zeal.models.gpt import sample_next
from zeal.models.hf import load_hf_model, model_folder
from zeal.train import data_efficiency_job
from zeal.train.metrics import MetricsSink, ProgressBar, plot_loss_curve
from zeal.utils.flops import flops_per_token, peak_flops
from zeal.utils.meta import meta_device
from zeal.utils.process import apply_process_settings

# ----------------------------------------------------------------------------------- data


def prepare_data(spec: JobSpec) -> tuple[Any, Any]:
    """(tokenizer, TokenBlocks) for the job; builds and caches what is missing.
    Safe to call from several processes at once (one builds, the others wait)."""
    from tokenizers import Tokenizer

    from zeal.data.corpus import file_corpus, stdlib_corpus
    from zeal.data.text_dataset import TokenBlocks, load_or_encode
    from zeal.data.tokenizer import load_or_train_tokenizer

    d = spec.data
    corpus = file_corpus(d.path) if d.path else stdlib_corpus(d.max_bytes)
    if spec.job.hf_model:
        tok_path = model_folder(spec.job.hf_model) / "tokenizer.json"
        if not tok_path.is_file():
            raise ValueError(f"job.hf_model {spec.job.hf_model!r} has no tokenizer.json")
        tokenizer = Tokenizer.from_file(str(tok_path))
    else:
        tokenizer = load_or_train_tokenizer(corpus, d.vocab_size, say=_say)
    ids = load_or_encode(corpus, tokenizer, say=_say)
    # at least one held-out block per rank, so every rank evaluates the same number of batches
    world = max(spec.job.nproc if not os.environ.get("WORLD_SIZE") else 1, int(os.environ.get("WORLD_SIZE", 1)))
    return tokenizer, TokenBlocks.split(ids, d.seq_len, d.heldout_fraction, d.seed, min_heldout=world)


def _say(msg: str) -> None:
    """Start-up progress, printed once (by the launcher, or rank 0)."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"zeal train: {msg}", flush=True)


def build_model(spec: JobSpec, vocab_size: int) -> torch.nn.Module | Callable[[], torch.nn.Module]:
    """The Hugging Face model to fine-tune, or a factory of the fresh zeal GPT: the
    engine calls it on the meta device and materialises the parameters shard by
    shard, so under ZeRO-3 no rank ever holds the whole model. The embedded model
    (SmolLM2) is zeal's own Llama, loaded as ``zeal serve`` loads it (no transformers
    needed: the default job runs on the core install); other folders go through
    transformers' ``AutoModelForCausalLM``."""
    if spec.job.hf_model:
        if spec.job.hf_model in SMOLLM2_NAMES:  # as zeal serve loads it (zeal.inference.loader), in fp32:
            return load_hf_model(model_folder(spec.job.hf_model), torch.float32)[0]  # the engine keeps its masters
        try:
            from transformers import AutoModelForCausalLM
        except ImportError:
            raise ValueError("job.hf_model needs the 'transformers' package (pip install 'zeal[hf]')") from None
        if not (Path(spec.job.hf_model) / "config.json").is_file():
            raise ValueError(f"job.hf_model {spec.job.hf_model!r} is not a Hugging Face folder (no config.json)")
        import transformers

        # fp32 weights: the engine keeps its own compute copy (bf16) and fp32 masters
        key = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
        return AutoModelForCausalLM.from_pretrained(spec.job.hf_model, **{key: torch.float32})
    from zeal.models import GPT, GPTConfig

    m = spec.model
    cfg = GPTConfig(vocab_size=vocab_size, n_positions=spec.data.seq_len, n_embd=m.n_embd, n_layer=m.n_layer,
                    n_head=m.n_head, dropout=m.dropout, num_experts=m.num_experts, moe_every=m.moe_every,
                    top_k=m.top_k, capacity_factor=m.capacity_factor, aux_loss_coef=m.aux_loss_coef,
                    ep_size=m.ep_size)
    return lambda: GPT(cfg)


# ----------------------------------------------------------------------------------- loop


def _loss_of(out: Any) -> torch.Tensor:
    return out.loss if hasattr(out, "loss") else out


def _logits_of(out: Any) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out


def _mean_over_ranks(values: list[float], comm: Comm) -> list[float]:
    """The mean of ``values`` over the ranks of ``comm`` (unchanged alone)."""
    t = torch.tensor(values, dtype=torch.float64)
    if comm.active:
        comm.all_reduce(t, "control")
        t /= comm.size
    return t.tolist()


@torch.no_grad()
def evaluate(engine: Any, blocks: Any, micro_batch: int, max_batches: int) -> float:
    """Mean held-out loss over every rank's share of the held-out blocks."""
    engine.eval()
    losses = [float(_loss_of(engine({"input_ids": b, "labels": b})))
              for b in blocks.heldout_batches(micro_batch, max_batches, engine.mesh.data_rank, engine.mesh.data_size)]
    engine.train()
    return _mean_over_ranks([sum(losses) / len(losses)], engine.mesh.dp)[0]


@torch.no_grad()
def sample(engine: Any, tokenizer: Any, prompt: str, max_new_tokens: int, temperature: float, top_k: int,
           seq_len: int, seed: int) -> str:
    """Generate on every rank in lockstep (ZeRO-3 needs every rank in every forward):
    rank 0 draws each token and broadcasts it. Every forward has the same shape: the
    context is right-padded to ``seq_len`` and the logits are read at its last real
    position (causal attention: the padding after it changes nothing). A forward per
    new length made the CPU kernels cache one set of buffers per shape: +145 MiB per
    rank over a 64-token sample, the default job's peak. zeal's Llama (the default job's
    SmolLM2) samples with its weights gathered once and a key/value cache instead
    (:mod:`zeal.train.cached_sample`): a 128-token forward per token is ~100x the work there."""
    from zeal.models.llama import Llama

    if isinstance(engine.module, Llama):
        from zeal.train.cached_sample import cached_sample

        return cached_sample(engine, tokenizer, prompt, max_new_tokens, temperature, top_k, seed)
    engine.eval()
    ids = torch.tensor([tokenizer.encode(prompt).ids or [0]], dtype=torch.long)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(max_new_tokens):
        ctx = ids[:, -seq_len:]
        n = ctx.shape[1]
        padded = torch.nn.functional.pad(ctx, (0, seq_len - n))
        logits = _logits_of(engine({"input_ids": padded}))[:, n - 1]
        nxt = sample_next(logits, temperature, top_k, gen)
        engine.mesh.world.broadcast(nxt, 0, "control")
        ids = torch.cat([ids, nxt], dim=1)
    engine.train()
    return tokenizer.decode(ids[0].tolist())


def peak_rss_bytes() -> int:
    """This process's peak resident set size (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _gather_ints(value: int, comm: Comm) -> list[int]:
    """Every rank's ``value``, in rank order."""
    t = torch.tensor([value], dtype=torch.int64)
    out = torch.zeros(comm.size, dtype=torch.int64)
    comm.all_gather(out, t, "control")
    return [int(x) for x in out]


@dataclass
class _Run:
    """What the parts of one job share: the spec, the engine, the data and the outputs."""

    spec: JobSpec
    engine: Any
    cfg: Any  # the validated engine config
    tokenizer: Any
    blocks: Any
    micro: int
    accum: int
    sink: MetricsSink
    start_step: int = 0
    tokens_done: int = 0
    elapsed_before: float = 0.0
    rss_before_model: int = 0
    de: Any = None  # data_efficiency_job.JobDataEfficiency: curricula, random-LTD, token counts
    tokens_before: int = 0  # tokens consumed before this process's first step (resume)
    flops_per_token: float = 0.0  # model FLOPs of one token's forward and backward (zeal.utils.flops)
    peak_flops: float = 0.0  # one rank's device peak

    @property
    def run_dir(self) -> Path:
        return Path(self.spec.job.run_dir)

    @property
    def is_main(self) -> bool:
        return self.engine.rank == 0

    @property
    def tokens_per_step(self) -> int:
        return self.micro * self.accum * (self.engine.world_size // self.engine.mesh.sp_size) * self.spec.data.seq_len

    def say(self, *args: Any, **kwargs: Any) -> None:
        if self.is_main:
            print(*args, **kwargs)

    def held_out(self, step: int) -> float:
        loss = evaluate(self.engine, self.blocks, self.micro, self.spec.job.eval_batches)
        self.sink.log({"step": step, "kind": "eval", "loss": loss, "tokens": self.tokens_done})
        return loss

    def save(self, step: int, elapsed: float) -> None:
        if self.spec.job.checkpoint:
            self.engine.save_checkpoint(str(self.run_dir / "checkpoints"), tag=f"step{step}", client_state={
                "step": step, "tokens": self.tokens_done, "elapsed_s": elapsed,
                "data_efficiency": self.de.state_dict()})


def run_job(spec: JobSpec) -> dict[str, Any]:
    """Train as the spec says, on this process's rank; returns the summary (rank 0's
    figures; every rank returns the same losses)."""
    apply_process_settings(spec.process)  # before any tensor: torch reads THP at its first allocation
    spec, auto_notes = resolve_auto(spec)
    spec = resolve_precision(spec)
    run = _start(spec)
    for note in auto_notes:
        run.say(note)
    if run.start_step >= spec.job.steps and spec.job.resume:
        run.say(f"already at step {run.start_step} (job.steps {spec.job.steps}); nothing to do", flush=True)
        run.sink.close()
        return {"steps": run.start_step, "start_step": run.start_step, "nothing_to_do": True}
    if spec.job.resume:
        run.sink.rewind(run.start_step)  # the steps after the checkpoint are redone: one row per step and kind
    eval_before = run.held_out(run.start_step)
    run.say(f"held-out loss at step {run.start_step}: {eval_before:.4f}", flush=True)
    final_step, train_loss, train_time = _train(run)
    return _finish(run, eval_before, final_step, train_loss, train_time)


def _start(spec: JobSpec) -> _Run:
    """Data, model, engine and (on resume) the saved position; rank 0 writes the spec."""
    from zeal.config import load_config
    from zeal.train.build import initialize

    j = spec.job
    ckpt_dir = Path(j.run_dir) / "checkpoints"
    if j.resume and not _has_checkpoint(ckpt_dir):
        raise ValueError(f"--resume: no checkpoint in {ckpt_dir}")
    torch.manual_seed(spec.data.seed)
    tokenizer, blocks = prepare_data(spec)
    rss_before_model = peak_rss_bytes()
    model = build_model(spec, tokenizer.get_vocab_size())
    fpt = _flops_per_token(model, spec.data.seq_len)  # before ZeRO partitions the weights
    engine = initialize(model, spec.engine)
    cfg = load_config(spec.engine)
    _, micro, accum = cfg.resolve_batch(engine.mesh.data_size)
    run = _Run(spec, engine, cfg, tokenizer, blocks, micro, accum,
               MetricsSink(Path(j.run_dir), enabled=engine.rank == 0, append=j.resume, report_to=j.report_to,
                           run_config=spec.model_dump()),
               rss_before_model=rss_before_model, flops_per_token=fpt)
    run.peak_flops, source = peak_flops(engine.device.type, engine.device.index or 0)
    run.say(f"mfu: {fpt:,.0f} model FLOPs per token (6N + attention) over a peak of {world_peak(run):.3g} FLOP/s "
            f"({source}, times {engine.world_size} ranks)", flush=True)
    run.de = data_efficiency_job.build(cfg, blocks, micro, accum, engine.mesh.data_size, engine.mesh.data_rank,
                                       getattr(engine, "token_drop", None))
    token_sched = data_efficiency_job.token_scheduler(j, cfg, engine.optimizer, run.de.counter)
    if token_sched is not None:
        engine.lr_scheduler = token_sched
    if run.is_main:
        run.run_dir.mkdir(parents=True, exist_ok=True)
        write_spec(spec, run.run_dir / "config.json")
        tokenizer.save(str(run.run_dir / "tokenizer.json"))
    if j.resume:
        state = engine.load_checkpoint(str(ckpt_dir)) or {}
        if isinstance(state, tuple):  # DeepSpeed-style (path, client_state)
            state = state[-1] or {}
        run.start_step = int(state.get("step", engine.global_steps))
        run.tokens_done = int(state.get("tokens", 0))
        run.elapsed_before = float(state.get("elapsed_s", 0.0))
        run.de.load_state_dict(state.get("data_efficiency") or {"tokens": run.tokens_done}, run.start_step)
        if token_sched is not None:
            token_sched.refresh()
    run.say("engine config (DeepSpeed keys, \"auto\" resolved; saved in config.json): "
            + json.dumps(spec.engine, separators=(",", ":")), flush=True)
    mixed = "bf16" if cfg.bf16.enabled else "fp16" if cfg.fp16.enabled else "fp32"
    run.say(f"zeal train: {_num_params(engine.module) / 1e6:.2f}M params, {engine.world_size} process(es), ZeRO "
            f"stage {cfg.zero_optimization.stage}, {mixed}, {len(blocks.train_index)} train / "
            f"{len(blocks.heldout_index)} held-out blocks of {spec.data.seq_len} tokens, {run.tokens_per_step} "
            f"tokens/step, steps {run.start_step}->{j.steps}, run folder {run.run_dir}", flush=True)
    return run


def _train(run: _Run) -> tuple[int, float, float]:
    """The optimizer steps from ``run.start_step`` to ``job.steps``; returns
    ``(final step, last train loss, train time in s)``."""
    from zeal.data.text_dataset import BlockSampler

    j, engine, blocks, start_step = run.spec.job, run.engine, run.blocks, run.start_step
    # data is sharded over the data-parallel ranks (tensor/pipeline ranks of one replica see the same batch)
    rank, world = engine.mesh.data_rank, engine.mesh.data_size
    sampler = BlockSampler(len(blocks.train_index), run.micro, run.accum, world, run.spec.data.seed)
    engine.train()
    bar = ProgressBar(j.steps, start_step, enabled=run.is_main, log_interval=j.log_interval)
    t0 = time.perf_counter()
    step = start_step
    train_loss = float("nan")
    tokens_at_start, counted_at_start = run.tokens_done, run.de.counter.tokens
    run.tokens_before = tokens_at_start
    final_step = start_step
    for step in range(start_step, j.steps):
        if j.train_tokens is not None and run.tokens_done >= j.train_tokens:
            break
        losses = []
        picked = run.de.begin_step(step)  # the curriculum sampler's ids, or None
        for m in range(run.accum):
            idx = picked[m * run.micro:(m + 1) * run.micro] if picked is not None else sampler.indices(step, m, rank)
            x = run.de.cut(blocks.batch(blocks.train_index[idx]))
            run.de.consume(x, world)
            loss = _loss_of(engine({"input_ids": x, "labels": x}))
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
        run.tokens_done = tokens_at_start + run.de.counter.tokens - counted_at_start
        final_step = step + 1
        train_loss = _mean_over_ranks([sum(losses) / len(losses)], engine.mesh.dp)[0]
        done = step + 1
        elapsed = time.perf_counter() - t0
        speed = (run.tokens_done - tokens_at_start) / max(elapsed, 1e-9)
        tflops = run.flops_per_token * speed / 1e12
        run.sink.log({"step": done, "kind": "train", "loss": train_loss, "lr": _current_lr(engine),
                      "grad_norm": _grad_norm(engine), "tokens": run.tokens_done, "tokens_per_s": speed,
                      "tflops": tflops, "mfu": tflops * 1e12 / world_peak(run) if run.peak_flops else None,
                      "elapsed_s": run.elapsed_before + elapsed, **run.de.metrics()})
        bar.update(done, train_loss, speed)
        if j.eval_interval and done % j.eval_interval == 0 and done < j.steps:
            bar.write(f"step {done}: held-out loss {run.held_out(done):.4f}")
        if j.save_interval and done % j.save_interval == 0 and done < j.steps:
            run.save(done, run.elapsed_before + elapsed)
    train_time = time.perf_counter() - t0
    bar.close()
    return final_step, train_loss, train_time


def _flops_per_token(model: Any, seq_len: int) -> float:
    """Model FLOPs per token of ``model`` (a module, or a factory built here on the meta device)."""
    if not isinstance(model, torch.nn.Module):
        with meta_device():
            model = model()
    return flops_per_token(model, seq_len)


def world_peak(run: _Run) -> float:
    """The job's peak FLOP/s: one rank's device peak times the ranks."""
    return run.peak_flops * run.engine.world_size


def _finish(run: _Run, eval_before: float, final_step: int, train_loss: float, train_time: float) -> dict[str, Any]:
    """Final evaluation, checkpoint and sample; the summary, written by rank 0."""
    spec, engine, cfg, start_step = run.spec, run.engine, run.cfg, run.start_step
    j, world = spec.job, engine.world_size
    eval_after = run.held_out(final_step)
    if j.steps > start_step:
        run.save(final_step, run.elapsed_before + train_time)
    run.say(f"held-out loss: {eval_before:.4f} -> {eval_after:.4f} (step {start_step} -> {final_step}), "
            f"train time {train_time:.1f} s", flush=True)
    text = ""
    if j.sample_tokens:
        text = sample(engine, run.tokenizer, j.sample_prompt, j.sample_tokens, j.temperature, j.top_k,
                      spec.data.seq_len, spec.data.seed)
        run.say("sample:\n" + text + "\n", flush=True)
    if getattr(engine, "lora", None) is not None:  # LoRA: the adapter as a PEFT folder (every rank gathers)
        engine.save_adapter(str(run.run_dir / "adapter"))
        run.say(f"wrote the LoRA adapter (PEFT folder) to {run.run_dir / 'adapter'}", flush=True)
    breakdown = engine.wall_clock_breakdown() if cfg.wall_clock_breakdown else None
    if breakdown:
        run.say("wall clock breakdown (s): " + ", ".join(f"{k} {v:.2f}" for k, v in breakdown.items()), flush=True)
    rss = _gather_ints(peak_rss_bytes(), engine.mesh.world)
    rss_before = _gather_ints(run.rss_before_model, engine.mesh.world)
    summary = {
        "steps": final_step, "start_step": start_step, "world_size": world, "params": _num_params(engine.module),
        "zero_stage": cfg.zero_optimization.stage, "bf16": cfg.bf16.enabled,
        "heldout_loss_before": eval_before, "heldout_loss_after": eval_after, "train_loss_last": train_loss,
        "train_time_s": train_time, "tokens": run.tokens_done,
        "tokens_per_s": (run.tokens_done - run.tokens_before) / max(train_time, 1e-9),
        "peak_rss_bytes_per_rank": rss, "rss_before_model_bytes_per_rank": rss_before,
        "memory_breakdown": _safe(engine, "memory_breakdown"),
        "wall_clock_breakdown": breakdown, "sample": text,
    }
    if run.is_main:
        (run.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        run.sink.close()
        png = plot_loss_curve(run.run_dir / "metrics.jsonl", run.run_dir / "loss.png",
                              x="tokens" if run.de.on else "step")
        run.say(f"wrote {run.run_dir}/metrics.csv, metrics.jsonl, summary.json" + (f", {png.name}" if png else ""),
                flush=True)
    return summary


def _num_params(module: torch.nn.Module) -> int:
    cfg = getattr(module, "config", None)
    if hasattr(cfg, "num_parameters"):  # a zeal GPT: its shards are not full-size tensors
        return int(cfg.num_parameters())
    return sum(p.numel() for p in module.parameters())  # an HF model (``num_parameters`` is a method there)


def checkpoint_step(ckpt_dir: str | Path) -> int | None:
    """The job step of the checkpoint ``resume`` would load from ``ckpt_dir`` (None: none readable)."""
    from zeal.checkpoint import files as cf
    from zeal.checkpoint.load import read_meta

    root = Path(ckpt_dir)
    try:
        tags = cf.resolve_tags(root, None)
    except cf.CheckpointError:
        return None
    for tag in tags:
        try:
            meta = read_meta(root / tag)
        except cf.CheckpointError:
            continue
        client = meta.get("client_state") or {}
        step = client.get("step") if isinstance(client, dict) else None
        return int(step) if isinstance(step, int) else int(meta["global_steps"])
    return None


def _has_checkpoint(ckpt_dir: Path) -> bool:
    return ckpt_dir.is_dir() and any(ckpt_dir.iterdir())


def _current_lr(engine: Any) -> float:
    sched = getattr(engine, "lr_scheduler", None)
    if sched is not None:
        return float(sched.get_last_lr()[0])
    return float(engine.optimizer.param_groups[0]["lr"])


def _grad_norm(engine: Any) -> float:
    try:
        g = engine.grad_norm
    except Exception:  # noqa: BLE001 - optional figure
        return math.nan
    return math.nan if g is None else float(g)


def _safe(engine: Any, name: str) -> Any:
    try:
        return getattr(engine, name)()
    except Exception:  # noqa: BLE001 - optional figure
        return None
