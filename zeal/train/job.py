"""A training job: what to train on what (``JobSpec``) and the loop that does it (``run_job``).

A job spec has four sections. ``model``, ``data`` and ``job`` are validated here;
``engine`` is a DeepSpeed-style config passed untouched to ``zeal.initialize``
(validated by ``zeal.config``). The default spec is `zeal train` with no
arguments: a ~1.3M-parameter GPT trained from scratch on the standard-library
corpus, on 2 processes, ZeRO stage 3, bf16 where the CPU has native bf16.

``run_job`` runs on every rank (all ranks call it; rank 0 alone prints and writes
metrics). It evaluates held-out loss before, periodically and after training,
saves checkpoints with ``engine.save_checkpoint`` (client state: the step, token
count and elapsed time, so ``resume`` continues the same schedule and the same
batches), prints a generated sample, and leaves in the run folder:
``config.json``, ``tokenizer.json``, ``metrics.jsonl``, ``metrics.csv``,
``loss.png``, ``summary.json`` and ``checkpoints/``.
"""

from __future__ import annotations

import copy
import json
import math
import os
import resource
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from zeal.dist.comm import Comm
from zeal.models.gpt import sample_next
from zeal.train.metrics import MetricsSink, ProgressBar, plot_loss_curve


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelSection(_Section):
    """Shape of the zeal GPT trained from scratch (ignored with ``job.hf_model``)."""

    n_layer: int = Field(4, ge=1, description="Transformer blocks.")
    n_embd: int = Field(128, ge=8, description="Hidden size; divisible by n_head.")
    n_head: int = Field(4, ge=1, description="Attention heads.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout probability.")

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelSection:
        if self.n_embd % self.n_head:
            raise ValueError(f"model.n_embd {self.n_embd} is not divisible by model.n_head {self.n_head}")
        return self


class DataSection(_Section):
    """Where the text comes from and how it is cut."""

    path: str | None = Field(None, description="A .txt or .jsonl file; None = the standard-library corpus.")
    max_bytes: int = Field(4_000_000, ge=1000, description="Cap on the standard-library corpus, in bytes.")
    vocab_size: int = Field(4096, ge=258, description="BPE vocabulary trained on the corpus (from-scratch jobs).")
    seq_len: int = Field(128, ge=2, description="Tokens per training block.")
    heldout_fraction: float = Field(0.05, gt=0, lt=1, description="Share of blocks kept for held-out loss.")
    seed: int = Field(1234, description="Seed of the train / held-out split and of the batch order.")


class JobSection(_Section):
    """The loop: length, processes, outputs."""

    steps: int = Field(400, ge=0, description="Optimizer steps to reach (a resumed job continues up to it).")
    nproc: int = Field(2, ge=1, description="Processes to run on (re-executes under torchrun when > 1).")
    run_dir: str = Field("runs/default", description="Folder for metrics, plots, samples and checkpoints.")
    resume: bool = Field(False, description="Continue from the latest checkpoint in run_dir/checkpoints.")
    precision: Literal["auto", "bf16", "fp32"] = Field(
        "auto", description="auto = bf16 if the CPU/GPU runs it natively, else fp32 (sets the engine's bf16.enabled).")
    hf_model: str | None = Field(None, description="A Hugging Face folder to fine-tune instead of a fresh GPT.")
    lr: float = Field(3e-3, gt=0, description="Peak learning rate of the default optimizer.")
    warmup_steps: int = Field(30, ge=0, description="Linear warm-up steps of the default schedule.")
    eval_interval: int = Field(100, ge=0, description="Held-out evaluation every N steps (0 = before/after only).")
    eval_batches: int = Field(8, ge=1, description="Held-out micro-batches per rank per evaluation.")
    save_interval: int = Field(200, ge=0, description="Checkpoint every N steps (0 = at the end only).")
    checkpoint: bool = Field(True, description="Write checkpoints at all (false for throwaway runs).")
    log_interval: int = Field(10, ge=1, description="Progress lines every N steps when not on a terminal.")
    sample_prompt: str = Field("def ", description="Prompt of the sample generated at the end.")
    sample_tokens: int = Field(64, ge=0, description="Tokens generated for the final sample (0 = none).")
    temperature: float = Field(0.8, ge=0, description="Sampling temperature of the final sample.")
    top_k: int = Field(40, ge=0, description="Top-k of the final sample (0 = off).")


class JobSpec(_Section):
    """A whole job: the three job sections plus the engine config (DeepSpeed keys)."""

    model: ModelSection = Field(default_factory=ModelSection)
    data: DataSection = Field(default_factory=DataSection)
    job: JobSection = Field(default_factory=JobSection)
    engine: dict[str, Any] = Field(default_factory=dict, description="Engine config, DeepSpeed JSON keys.")


def check_spec(spec: JobSpec) -> None:
    """Checks that need the file system, done before any process is started."""
    if spec.data.path and not Path(spec.data.path).is_file():
        raise ValueError(f"data.path {spec.data.path!r} is not a file")
    if spec.job.hf_model:
        folder = Path(spec.job.hf_model)
        for name in ("config.json", "tokenizer.json"):
            if not (folder / name).is_file():
                raise ValueError(f"job.hf_model {spec.job.hf_model!r} has no {name} (a Hugging Face model folder "
                                 "with a fast tokenizer is needed)")


def default_engine_config(job: JobSection) -> dict[str, Any]:
    """Engine settings of the default job: ZeRO-3, AdamW with warm-up + cosine decay, clipping 1."""
    return {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": job.lr, "betas": [0.9, 0.95], "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupCosineLR", "params": {
            "total_num_steps": max(1, job.steps), "warmup_num_steps": min(job.warmup_steps, max(0, job.steps - 1)),
            "warmup_min_ratio": 0.0, "cos_min_ratio": 0.1}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 3},
        "steps_per_print": 10**9,
        "seed": 1234,
    }


_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def merge_engine_config(job: JobSection, user: dict[str, Any]) -> dict[str, Any]:
    """The default engine config overlaid with the user's: sections merge key by key,
    except ``optimizer`` and ``scheduler`` (a user's one replaces the default whole)
    and the batch keys (a user giving any of them drops the defaults' others, so
    DeepSpeed's "any two give the third" holds)."""
    out = default_engine_config(job)
    if any(k in user for k in _BATCH_KEYS):
        for k in _BATCH_KEYS:
            out.pop(k, None)
    return _deep_merge(out, user, replace=("optimizer", "scheduler"))


def _deep_merge(base: dict, over: dict, replace: tuple[str, ...] = ()) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict) and k not in replace:
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def native_bf16() -> bool:
    """Whether this machine computes bf16 natively: a CUDA GPU with bf16, or a CPU
    with AVX512-BF16 or AMX (elsewhere bf16 on CPU is emulated and slower than fp32)."""
    if torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(f in flags for f in (" avx512_bf16", " amx_bf16"))


def resolve_precision(spec: JobSpec) -> JobSpec:
    """Set the engine's ``bf16.enabled`` from ``job.precision`` unless the engine
    config already decides it (``bf16.enabled`` true/false or fp16 enabled)."""
    engine = copy.deepcopy(spec.engine)
    bf16 = engine.get("bf16") if isinstance(engine.get("bf16"), dict) else {}
    fp16_on = isinstance(engine.get("fp16"), dict) and engine["fp16"].get("enabled") is True
    if bf16.get("enabled") in (None, "auto") and not fp16_on:
        want = spec.job.precision == "bf16" or (spec.job.precision == "auto" and native_bf16())
        engine["bf16"] = {**bf16, "enabled": want}
    return spec.model_copy(update={"engine": engine})


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
        tok_path = Path(spec.job.hf_model) / "tokenizer.json"
        if not tok_path.is_file():
            raise ValueError(f"job.hf_model {spec.job.hf_model!r} has no tokenizer.json")
        tokenizer = Tokenizer.from_file(str(tok_path))
    else:
        tokenizer = load_or_train_tokenizer(corpus, d.vocab_size)
    ids = load_or_encode(corpus, tokenizer)
    # at least one held-out block per rank, so every rank evaluates the same number of batches
    world = max(spec.job.nproc if not os.environ.get("WORLD_SIZE") else 1, int(os.environ.get("WORLD_SIZE", 1)))
    return tokenizer, TokenBlocks.split(ids, d.seq_len, d.heldout_fraction, d.seed, min_heldout=world)


def build_model(spec: JobSpec, vocab_size: int) -> torch.nn.Module | Callable[[], torch.nn.Module]:
    """The Hugging Face model to fine-tune, or a factory of the fresh zeal GPT: the
    engine calls it on the meta device and materialises the parameters shard by
    shard, so under ZeRO-3 no rank ever holds the whole model."""
    if spec.job.hf_model:
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
                    n_head=m.n_head, dropout=m.dropout)
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
              for b in blocks.heldout_batches(micro_batch, max_batches, engine.mesh.dp_rank, engine.mesh.dp_size)]
    engine.train()
    return _mean_over_ranks([sum(losses) / len(losses)], engine.mesh.dp)[0]


@torch.no_grad()
def sample(engine: Any, tokenizer: Any, prompt: str, max_new_tokens: int, temperature: float, top_k: int,
           seq_len: int, seed: int) -> str:
    """Generate on every rank in lockstep (ZeRO-3 needs every rank in every forward):
    rank 0 draws each token and broadcasts it."""
    engine.eval()
    ids = torch.tensor([tokenizer.encode(prompt).ids or [0]], dtype=torch.long)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(max_new_tokens):
        logits = _logits_of(engine({"input_ids": ids[:, -seq_len:]}))[:, -1]
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


def write_spec(spec: JobSpec, path: Path) -> None:
    """Write the resolved spec as JSON (what child processes and `zeal generate` read)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(spec.model_dump(), indent=2) + "\n")
    os.replace(tmp, path)


def read_spec(path: str | Path) -> JobSpec:
    """A spec written by ``write_spec``."""
    return JobSpec.model_validate_json(Path(path).read_text())


def run_job(spec: JobSpec) -> dict[str, Any]:
    """Train as the spec says, on this process's rank; returns the summary (rank 0's
    figures; every rank returns the same losses)."""
    import zeal
    from zeal.config import load_config

    spec = resolve_precision(spec)
    j = spec.job
    run_dir = Path(j.run_dir)
    ckpt_dir = run_dir / "checkpoints"
    if j.resume and not _has_checkpoint(ckpt_dir):
        raise ValueError(f"--resume: no checkpoint in {ckpt_dir}")
    torch.manual_seed(spec.data.seed)
    tokenizer, blocks = prepare_data(spec)
    rss_before_model = peak_rss_bytes()
    model = build_model(spec, tokenizer.get_vocab_size())
    engine = zeal.initialize(model, spec.engine)
    rank, world = engine.rank, engine.world_size
    cfg = load_config(spec.engine)
    _, micro, accum = cfg.resolve_batch(engine.mesh.dp_size)
    is_main = rank == 0
    if is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        write_spec(spec, run_dir / "config.json")
        tokenizer.save(str(run_dir / "tokenizer.json"))

    start_step, tokens_done, elapsed_before = 0, 0, 0.0
    if j.resume:
        state = engine.load_checkpoint(str(ckpt_dir)) or {}
        if isinstance(state, tuple):  # DeepSpeed-style (path, client_state)
            state = state[-1] or {}
        start_step = int(state.get("step", engine.global_steps))
        tokens_done = int(state.get("tokens", 0))
        elapsed_before = float(state.get("elapsed_s", 0.0))

    n_params = _num_params(engine.module)
    from zeal.data.text_dataset import BlockSampler

    sampler = BlockSampler(len(blocks.train_index), micro, accum, world, spec.data.seed)
    tokens_per_step = micro * accum * world * spec.data.seq_len
    sink = MetricsSink(run_dir, enabled=is_main, append=j.resume)
    say = print if is_main else (lambda *a, **k: None)
    say(f"zeal train: {n_params / 1e6:.2f}M params, {world} process(es), ZeRO stage "
        f"{cfg.zero_optimization.stage}, {'bf16' if cfg.bf16.enabled else 'fp16' if cfg.fp16.enabled else 'fp32'}, "
        f"{len(blocks.train_index)} train / {len(blocks.heldout_index)} held-out blocks of {spec.data.seq_len} "
        f"tokens, {tokens_per_step} tokens/step, steps {start_step}->{j.steps}, run folder {run_dir}", flush=True)

    def held_out(step: int) -> float:
        loss = evaluate(engine, blocks, micro, j.eval_batches)
        sink.log({"step": step, "kind": "eval", "loss": loss})
        return loss

    def save(step: int, elapsed: float) -> None:
        if not j.checkpoint:
            return
        engine.save_checkpoint(str(ckpt_dir), tag=f"step{step}",
                               client_state={"step": step, "tokens": tokens_done, "elapsed_s": elapsed})

    eval_before = held_out(start_step)
    say(f"held-out loss at step {start_step}: {eval_before:.4f}", flush=True)
    engine.train()
    bar = ProgressBar(j.steps, start_step, enabled=is_main, log_interval=j.log_interval)
    t0 = time.perf_counter()
    step = start_step
    train_loss = float("nan")
    for step in range(start_step, j.steps):
        losses = []
        for m in range(accum):
            x = blocks.batch(blocks.train_index[sampler.indices(step, m, rank)])
            loss = _loss_of(engine({"input_ids": x, "labels": x}))
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
        tokens_done += tokens_per_step
        train_loss = _mean_over_ranks([sum(losses) / len(losses)], engine.mesh.dp)[0]
        done = step + 1
        lr = _current_lr(engine)
        elapsed = time.perf_counter() - t0
        sink.log({"step": done, "kind": "train", "loss": train_loss, "lr": lr, "grad_norm": _grad_norm(engine),
                  "tokens": tokens_done, "tokens_per_s": (done - start_step) * tokens_per_step / max(elapsed, 1e-9),
                  "elapsed_s": elapsed_before + elapsed})
        bar.update(done, train_loss, (done - start_step) * tokens_per_step / max(elapsed, 1e-9))
        if j.eval_interval and done % j.eval_interval == 0 and done < j.steps:
            bar.write(f"step {done}: held-out loss {held_out(done):.4f}")
        if j.save_interval and done % j.save_interval == 0 and done < j.steps:
            save(done, elapsed_before + elapsed)
    train_time = time.perf_counter() - t0
    bar.close()
    final_step = max(step + 1, start_step) if j.steps > start_step else start_step
    eval_after = held_out(final_step)
    if j.steps > start_step:
        save(final_step, elapsed_before + train_time)
    say(f"held-out loss: {eval_before:.4f} -> {eval_after:.4f} (step {start_step} -> {final_step}), "
        f"train time {train_time:.1f} s", flush=True)

    text = ""
    if j.sample_tokens:
        text = sample(engine, tokenizer, j.sample_prompt, j.sample_tokens, j.temperature, j.top_k,
                      spec.data.seq_len, spec.data.seed)
        say("sample:\n" + text + "\n", flush=True)
    breakdown = engine.wall_clock_breakdown() if cfg.wall_clock_breakdown else None
    if breakdown:
        say("wall clock breakdown (s): " + ", ".join(f"{k} {v:.2f}" for k, v in breakdown.items()), flush=True)
    rss = _gather_ints(peak_rss_bytes(), engine.mesh.world)
    rss_before = _gather_ints(rss_before_model, engine.mesh.world)
    summary = {
        "steps": final_step, "start_step": start_step, "world_size": world, "params": n_params,
        "zero_stage": cfg.zero_optimization.stage, "bf16": cfg.bf16.enabled,
        "heldout_loss_before": eval_before, "heldout_loss_after": eval_after, "train_loss_last": train_loss,
        "train_time_s": train_time, "tokens": tokens_done,
        "tokens_per_s": (final_step - start_step) * tokens_per_step / max(train_time, 1e-9),
        "peak_rss_bytes_per_rank": rss, "rss_before_model_bytes_per_rank": rss_before,
        "memory_breakdown": _safe(engine, "memory_breakdown"),
        "wall_clock_breakdown": breakdown, "sample": text,
    }
    if is_main:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        sink.close()
        png = plot_loss_curve(run_dir / "metrics.jsonl", run_dir / "loss.png")
        say(f"wrote {run_dir}/metrics.csv, metrics.jsonl, summary.json" + (f", {png.name}" if png else ""),
            flush=True)
    return summary


def _num_params(module: torch.nn.Module) -> int:
    cfg = getattr(module, "config", None)
    if hasattr(cfg, "num_parameters"):  # a zeal GPT: its shards are not full-size tensors
        return int(cfg.num_parameters())
    return sum(p.numel() for p in module.parameters())  # an HF model (``num_parameters`` is a method there)


def _has_checkpoint(ckpt_dir: Path) -> bool:
    return ckpt_dir.is_dir() and any(ckpt_dir.iterdir())


def _current_lr(engine: Any) -> float:
    sched = getattr(engine, "lr_scheduler", None)
    if sched is not None:
        return float(sched.get_last_lr()[0])
    return float(engine.optimizer.param_groups[0]["lr"])


def _grad_norm(engine: Any) -> float:
    try:
        g = engine.get_global_grad_norm()
    except Exception:  # noqa: BLE001 - optional figure
        return math.nan
    return math.nan if g is None else float(g)


def _safe(engine: Any, name: str) -> Any:
    try:
        return getattr(engine, name)()
    except Exception:  # noqa: BLE001 - optional figure
        return None
