"""What every RLHF job shares: the policy model and tokenizer, the engine, a frozen
reference copy, the run folder (metrics.csv/jsonl, a PNG of reward and KL,
checkpoints that resume)."""

from __future__ import annotations

import copy
import hashlib
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from zeal.inference.tokenizer import Tokenizer
from zeal.rlhf.config import RLHFConfig
from zeal.train.metrics import MetricsSink, read_metrics

log = logging.getLogger("zeal.rlhf")

METRIC_COLUMNS = ("step", "kind", "loss", "reward", "kl", "response_length", "value_loss", "accuracy",
                  "logprob_diff", "time_generate_s", "time_train_s", "time_sync_s", "tflops", "mfu", "elapsed_s")


@dataclass
class Policy:
    """A zeal model with its tokenizer (None: token ids only) and end-of-sequence ids."""

    model: nn.Module
    tokenizer: Tokenizer | None
    eos_ids: list[int]

    @property
    def pad_id(self) -> int:
        return self.eos_ids[0] if self.eos_ids else 0


def say(job: str | None, msg: str) -> None:
    """A phase line ``[job] msg`` on the first rank (none without ``job``): every phase
    of a few seconds or more says what it does before it starts."""
    if job and int(os.environ.get("RANK", "0")) == 0:
        print(f"[{job}] {msg}", flush=True)


def load_policy(model: Any, tokenizer: Any = None, eos_token_ids: list[int] | None = None,
                job: str | None = None) -> Policy:
    """A module as is, or a Hugging Face folder / ``.gguf`` / None (the embedded SmolLM2-135M-Instruct)
    loaded in fp32 (its tokenizer and end-of-sequence ids come with it). ``job``: the name
    the loading is announced under (see :func:`say`)."""
    from zeal.inference.llm import load_model_and_tokenizer, load_tokenizer

    if isinstance(model, nn.Module):
        tok, eos = None, []
    else:
        say(job, f"loading {'the embedded SmolLM2-135M-Instruct' if model is None else model} in fp32")
        model, tok, eos = load_model_and_tokenizer(model)
    if tokenizer is not None:
        tok = tokenizer if isinstance(tokenizer, Tokenizer) else load_tokenizer(tokenizer)
    eos = list(eos) + [e for e in (eos_token_ids or []) if e not in eos]
    if tok is not None:
        eos += [e for e in tok.eos_token_ids if e not in eos]
    return Policy(model, tok, eos)


def sampling_seed(seed: int, step: int, attempt: int = 0) -> int:
    """The base sampling seed of a step's rollouts (answer i of prompt k adds ``k·n + i``,
    a rank its offset): a hash of the run's seed, the step and the generation attempt, so
    that runs with nearby seeds draw unrelated streams (a plain ``seed + c·step`` made seed
    s + 1's answer k the same draw as seed s's answer k + 1)."""
    digest = hashlib.blake2b(f"zeal-rollouts:{seed}:{step}:{attempt}".encode(), digest_size=7).digest()
    return int.from_bytes(digest, "little")


def encode_prompt(prompt: Any, tok: Tokenizer | None, rc: RLHFConfig) -> list[int]:
    """Token ids of a prompt (text through the chat template when ``rc.chat``, or ids; a row
    dict: its ``prompt``), cut to its last ``max_prompt_len`` tokens."""
    if isinstance(prompt, dict) and "prompt" in prompt:
        return encode_prompt(prompt["prompt"], tok, rc)
    if isinstance(prompt, str):
        if tok is None:
            raise ValueError("text prompts need a tokenizer (the model has none): give token ids")
        ids = tok.encode_chat([{"role": "user", "content": prompt}]) if rc.chat else tok.encode(prompt)
    elif isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
        if tok is None:
            raise ValueError("chat prompts need a tokenizer")
        ids = tok.encode_chat(prompt)
    else:
        ids = [int(t) for t in prompt]
    if not ids:
        raise ValueError("a prompt is empty")
    return ids[-rc.max_prompt_len:]


def frozen_copy(model: nn.Module) -> nn.Module:
    """A frozen, eval-mode copy (the reference model); take it before ``zeal.initialize``."""
    ref = copy.deepcopy(model).eval()
    ref.requires_grad_(False)
    return ref


def disable_dropout(model: nn.Module) -> None:
    """Dropout off (old and new log-probs must agree at ratio 1)."""
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0


def build_engine(model: nn.Module, engine_cfg: dict, micro_batch: int, lr: float | None = None,
                 job: str | None = None, what: str = "training engine"):
    """``zeal.initialize`` over ``model`` with the job's batch (one micro-batch per step unless
    the config says otherwise); announced under ``job`` (see :func:`say`)."""
    import zeal

    stage = (engine_cfg.get("zero_optimization") or {}).get("stage", 0)
    say(job, f"building the {what} ({sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters, "
        f"ZeRO stage {stage}, {os.environ.get('WORLD_SIZE', '1')} rank(s))")
    cfg = copy.deepcopy(engine_cfg)
    cfg.setdefault("train_micro_batch_size_per_gpu", micro_batch)
    cfg.pop("train_batch_size", None)
    if lr is not None:
        cfg.setdefault("optimizer", {}).setdefault("params", {})["lr"] = lr
    return zeal.initialize(model, cfg)


@dataclass
class RunResult:
    """What a job returns: the trained engine(s), the metrics records and the run folder."""

    engine: Any
    metrics: list[dict] = field(default_factory=list)
    out: Path | None = None
    extra: dict = field(default_factory=dict)


def dp_slice(engine) -> tuple[int, int]:
    """``(data-parallel rank, data-parallel size)`` of ``engine``: a step draws one global
    batch of ``size`` × the per-rank batch with the same seeded generator on every rank,
    and rank ``r`` takes the ``r``-th slice (so ``n`` ranks see what one process with an
    ``n`` times larger batch would)."""
    mesh = getattr(engine, "mesh", None)
    return (mesh.dp_rank, mesh.dp_size) if mesh is not None else (0, 1)


class RunLog:
    """The run folder of a job (rank 0 writes): metrics, a reward/KL plot, checkpoints.
    With ``comm`` (the engine's data-parallel :class:`~zeal.dist.comm.Comm`) every logged
    value is the mean over its ranks (every rank calls :meth:`log`, with the same keys).

    Nothing in the folder is replaced before the first step is logged: a job that fails
    earlier (on its data, its model) leaves the earlier results as they were. Then a
    resumed run keeps the metrics up to its checkpoint's step (the redone steps are
    rewritten, one row per step), and a fresh start into a folder holding earlier results
    moves them aside into ``earlier-<time>/`` (said in one line)."""

    EARLIER = ("metrics.csv", "metrics.jsonl", "reward_kl.png", "checkpoints", "model", "value_model.safetensors",
               "reward_model.json", "actor_ema.safetensors")  # what a run writes into its folder

    def __init__(self, out: str | os.PathLike | None, rank: int, job: str, rc: RLHFConfig, comm=None) -> None:
        self.comm = comm if comm is not None and comm.active else None
        self.out = Path(out) if out is not None else None
        self.enabled = rank == 0 and self.out is not None
        self.job, self.rc = job, rc
        self.t0 = time.perf_counter()
        self.records: list[dict] = []
        self.sink = None
        self.start_step: int | None = None  # the resumed step (None: a fresh start)
        if self.out is not None:
            self.out.mkdir(parents=True, exist_ok=True)

    def _open_sink(self) -> None:
        """At the first logged step (rank 0): continue the resumed run's metrics, or move an
        earlier run's results aside, then open the metrics files."""
        if not self.enabled or self.sink is not None:
            return
        append = self.start_step is not None and (self.out / "metrics.jsonl").exists()
        if self.start_step is None:
            self._move_earlier()
        self.sink = MetricsSink(self.out, enabled=True, append=append, report_to=[], columns=METRIC_COLUMNS)
        if append:
            self.sink.rewind(self.start_step)

    def _move_earlier(self) -> None:
        found = [n for n in self.EARLIER if (self.out / n).exists() or (self.out / n).is_symlink()]
        if not found:
            return
        base = dest = self.out / time.strftime("earlier-%Y%m%d-%H%M%S", time.gmtime())
        k = 1
        while dest.exists():
            dest, k = base.with_name(f"{base.name}-{k}"), k + 1
        dest.mkdir()
        for n in found:
            os.replace(self.out / n, dest / n)
        print(f"zeal rlhf {self.job}: a fresh start (no checkpoint resumed): moved the earlier results in "
              f"{self.out} ({', '.join(found)}) to {dest}", flush=True)

    @property
    def ckpt_dir(self) -> Path | None:
        return self.out / "checkpoints" if self.out is not None else None

    def has_checkpoint(self) -> bool:
        return self.ckpt_dir is not None and (self.ckpt_dir / "latest").exists()

    def resume(self, engine, sub: str | None = None) -> int:
        """The step to start at: 0, or the one after the last checkpoint when resuming
        (``sub``: a second engine's checkpoints, in that sub-folder)."""
        if not (self.rc.resume and self.has_checkpoint()):
            return 0
        client = engine.load_checkpoint(str(self.ckpt_dir / sub if sub else self.ckpt_dir)) or {}
        step = int(client.get("rlhf_step", 0))
        if sub is None:
            self.start_step = step
        log.info("%s: resumed from %s at step %d", self.job, self.ckpt_dir, step)
        return step

    def _dp_mean(self, values: dict[str, float]) -> dict[str, float]:
        if self.comm is None or not values:
            return values
        keys = sorted(values)
        t = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=self.comm.ctx.device)
        self.comm.all_reduce(t, "control")
        return {k: float(v) / self.comm.size for k, v in zip(keys, t.tolist())}

    def log(self, step: int, **values: float) -> dict:
        self._open_sink()  # before the collective: no rank saves a checkpoint before the folder is ready
        values = self._dp_mean({k: float(v) for k, v in values.items() if v is not None})
        rec = {"step": step, "kind": "train", **values,
               "elapsed_s": time.perf_counter() - self.t0}
        self.records.append(rec)
        if self.sink is not None:
            self.sink.log(rec)
        if self.enabled and (step % self.rc.log_every == 0 or step == self.rc.steps):
            shown = " ".join(f"{k} {rec[k]:.4g}" for k in ("loss", "reward", "kl", "accuracy", "response_length")
                             if k in rec)
            print(f"[{self.job}] step {step}/{self.rc.steps} {shown}", flush=True)
        return rec

    def saves(self, step: int, final: bool = False) -> bool:
        """Whether :meth:`checkpoint` saves at ``step``."""
        every = self.rc.save_every
        return self.ckpt_dir is not None and (final or bool(every and step % every == 0))

    def checkpoint(self, engine, step: int, final: bool = False, sub: str | None = None) -> None:
        """Every rank calls it; saves at ``save_every`` and at the end (``sub``: a second
        engine's checkpoints, saved before the main one, whose ``latest`` marks a resumable run)."""
        if self.saves(step, final):
            where = self.ckpt_dir / sub if sub else self.ckpt_dir
            engine.save_checkpoint(str(where), tag=f"step{step}", client_state={"rlhf_step": step})

    def close(self) -> None:
        if self.sink is not None:
            self.sink.close()
            plot_reward_kl(self.out / "metrics.jsonl", self.out / "reward_kl.png")


def plot_reward_kl(metrics_jsonl: Path, out_png: Path) -> Path | None:
    """Reward and KL against step (two panels) as a PNG; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    recs = read_metrics(metrics_jsonl)
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5), dpi=100)
    for ax, key in zip(axes, ("reward", "kl")):
        pts = [(r["step"], r[key]) for r in recs if r.get(key) is not None]
        if pts:
            ax.plot(*zip(*pts), linewidth=1)
        ax.set_xlabel("step")
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_png)
    plt.close(fig)
    return out_png


def set_seed(seed: int) -> torch.Generator:
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)
