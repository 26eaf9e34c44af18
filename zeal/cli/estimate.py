"""`zeal estimate`: peak memory per rank for every ZeRO stage and offload choice.

The model is a zeal GPT given by its shape (``--n-layer``, ``--n-embd``, ...) or a
Hugging Face ``config.json`` (``--hf-config``). ``--config`` reads micro-batch,
precision and stage from a zeal/DeepSpeed config. The table shows, per rank, the
model states, the step's working memory (activations of one micro-batch, gradient
and gather buffers, optimizer-step temporaries) and the process baseline plus
allocator slack (CPU runs), and the peak they add up to.

With ``--budget`` the command searches stage × offload × activation checkpointing ×
micro-batch (``--micro-batch`` and the powers of two below it) for the cheapest
configuration whose peak fits, cheapest meaning, in this order: no offload before
offload, then least communication and offload traffic (stages 0, 1 and 2 move the same
bytes; then stage 3, stage 1/2 + CPU optimizer, stage 3 + offloads, CPU before NVMe;
so plain stage 3 wins over stage 2 + CPU offload when both fit); no checkpointing before
checkpointing (recompute); the larger micro-batch; the lower stage. It prints the
config sections to use. Formulas: :mod:`zeal.zero.estimate`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from zeal.cli.estimate_long import run_long
from zeal.zero.estimate import (
    ModelShape,
    Plan,
    all_plans,
    candidate_plans,
    fmt_bytes,
    gpt_shape,
    hf_shape,
    implemented_on,
    parse_bytes,
    recommend,
)
from zeal.zero.estimate_long import LONG_CONTEXT_TOKENS

COLUMNS = ("params", "grads", "optimizer", "activations", "buffers", "step temps", "base+slack", "device", "cpu",
           "nvme")


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``zeal estimate``."""
    p = subparsers.add_parser(
        "estimate", help="per-rank memory for every ZeRO stage and offload; pick one for a budget",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    p.add_argument("--hf-config", metavar="JSON", help="a Hugging Face config.json (or its folder; 'smollm2': the "
                                                     "embedded SmolLM2-135M-Instruct, the default `zeal train` job's)")
    p.add_argument("--n-layer", type=int, default=4, help="zeal GPT layers (default 4)")
    p.add_argument("--n-embd", type=int, default=128, help="zeal GPT hidden size (default 128)")
    p.add_argument("--n-head", type=int, default=4, help="zeal GPT heads (default 4)")
    p.add_argument("--vocab-size", type=int, default=4096, help="zeal GPT vocabulary (default 4096)")
    p.add_argument("--world-size", type=int, default=2, help="data-parallel ranks (default 2)")
    p.add_argument("--config", help="zeal/DeepSpeed config (micro-batch, bf16/fp16, stage, checkpointing)")
    p.add_argument("--micro-batch", type=int, default=None,
                   help="samples per rank per forward (default: from --config, else 8); with --budget the "
                        "largest one tried")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sample (default 128)")
    p.add_argument("--precision", choices=["bf16", "fp16", "fp32"], default=None,
                   help="mixed precision (bf16/fp16) or fp32 (default: from --config, else bf16)")
    p.add_argument("--checkpointing", action="store_true",
                   help="the table with activation checkpointing, one per block (--budget tries both)")
    p.add_argument("--no-flash", action="store_true", help="attention keeps its s×s probabilities")
    p.add_argument("--device", choices=["cpu", "gpu"], default="cpu",
                   help="where training runs: cpu counts host RAM with the process baseline and glibc's heap "
                        "slack (measured); gpu counts tensors only (default cpu)")
    p.add_argument("--budget", help="device memory per rank, e.g. 16GB or 80GiB: recommend a configuration")
    p.add_argument("--cpu-budget", help="host memory per rank for offloaded state")
    p.add_argument("--json", action="store_true", help="print the plans as JSON")
    p.add_argument("--long-context", action="store_true",
                   help="plan one long sequence: sequence-parallel size x ALST tiling x checkpointing (taken by "
                        "--budget from --seq-len 16384 on; docs/long_context.md)")
    p.add_argument("--max-sp", type=int, default=64, help="largest sequence_parallel_size tried (default 64)")
    p.add_argument("--lora", nargs="?", const="", metavar="K=V,...",
                   help="plan LoRA / QLoRA (zeal train's flag, e.g. r=16,target_modules=all-linear,quantize_base=int4;"
                        " a lora section of --config counts too): frozen base, adapter states, quantized base bytes")
    return p


def _hf_config_path(name: str) -> Path:
    """The config.json of ``--hf-config``: a file, a folder holding one, or the embedded model's name."""
    from zeal.config.job import SMOLLM2_NAMES

    if name in SMOLLM2_NAMES:
        from zeal.models.hf import model_folder

        return model_folder(name) / "config.json"
    path = Path(name)
    return path / "config.json" if path.is_dir() else path


def _shape(args: argparse.Namespace) -> ModelShape:
    if args.hf_config:
        path = _hf_config_path(args.hf_config)
        if not path.is_file():
            raise ValueError(f"--hf-config {args.hf_config!r}: no such file")
        try:
            return hf_shape(json.loads(path.read_text()))
        except json.JSONDecodeError as e:
            raise ValueError(f"--hf-config {str(path)!r} is not valid JSON: {e.msg}") from None
    if min(args.n_layer, args.n_embd, args.n_head, args.vocab_size) < 1 or args.n_embd % args.n_head:
        raise ValueError(f"--n-embd {args.n_embd} must be a positive multiple of --n-head {args.n_head}")
    return gpt_shape(args.n_layer, args.n_embd, args.n_head, args.vocab_size, args.seq_len)


def _lora(args: argparse.Namespace, section):
    """The :class:`LoraSpec` of ``--lora`` or of the config's enabled ``lora`` section (None: full training)."""
    from zeal.cli.lora_flag import parse_lora_flag
    from zeal.config.lora import LoraConfig
    from zeal.zero.estimate_lora import LoraSpec

    if args.lora is not None:
        section = LoraConfig(**parse_lora_flag(args.lora))
    if section is None or not section.enabled:
        return None
    hf = {}
    if args.hf_config:
        hf = json.loads(_hf_config_path(args.hf_config).read_text())
    return LoraSpec.from_config(section, hf.get("num_key_value_heads"), hf.get("head_dim"))


def _values(p: Plan) -> tuple[int, ...]:
    return (p.states.params, p.states.grads, p.states.optimizer, p.activations, p.grad_buffers + p.gathered,
            p.step_temporaries, p.baseline + p.slack, p.device, p.cpu, p.nvme)


def _plan_json(p: Plan) -> dict:
    return {"stage": p.stage, "offload": p.offload, "checkpointing": p.checkpointing, "micro_batch": p.micro_batch,
            "params": p.states.params, "grads": p.states.grads, "optimizer": p.states.optimizer,
            "activations": p.activations, "activations_kept": p.activations_kept, "grad_buffers": p.grad_buffers,
            "gathered": p.gathered, "step_temporaries": p.step_temporaries, "baseline": p.baseline,
            "slack": p.slack, "device": p.device, "cpu": p.cpu, "nvme": p.nvme}


def run(args: argparse.Namespace) -> int:
    """Print the table (and the recommendation)."""
    from zeal.config import AutoValues, load_config

    if args.world_size < 1:
        raise ValueError(f"--world-size must be >= 1, got {args.world_size}")
    micro, precision, chosen_stage, ckpt, lora_section = 8, "bf16", None, args.checkpointing, None
    if args.config:
        cfg = load_config(args.config, AutoValues(micro_batch=args.micro_batch, strict=False))  # sizes only
        _, micro, _ = cfg.resolve_batch(args.world_size)
        precision = "bf16" if cfg.bf16.enabled else "fp16" if cfg.fp16.enabled else "fp32"
        chosen_stage = cfg.zero_optimization.stage
        ckpt = ckpt or cfg.activation_checkpointing is not None
        lora_section = cfg.lora
    micro = args.micro_batch if args.micro_batch is not None else micro
    precision = args.precision or precision
    if micro < 1 or args.seq_len < 1:
        raise ValueError("--micro-batch and --seq-len must be >= 1")
    shape = _shape(args)
    if args.long_context or (args.budget and args.seq_len >= LONG_CONTEXT_TOKENS):
        if args.max_sp < 1:
            raise ValueError(f"--max-sp must be >= 1, got {args.max_sp}")
        return run_long(args, shape, precision)
    kw = dict(seq_len=args.seq_len, mixed_precision=precision != "fp32", flash_attention=not args.no_flash,
              host=args.device == "cpu", lora=_lora(args, lora_section))
    plans = all_plans(shape, args.world_size, micro_batch=micro, checkpointing=ckpt, **kw)
    budget = parse_bytes(args.budget) if args.budget else None
    cpu_budget = parse_bytes(args.cpu_budget) if args.cpu_budget else None
    best = None
    if budget is not None:
        best = recommend([p for p in candidate_plans(shape, args.world_size, micro, **kw)
                          if implemented_on(p, "cuda" if args.device == "gpu" else args.device)], budget, cpu_budget)
    if args.json:
        print(json.dumps({"model": shape.name, "params": shape.num_params, "world_size": args.world_size,
                          "micro_batch": micro, "seq_len": args.seq_len, "precision": precision,
                          "checkpointing": ckpt, "device_type": args.device,
                          "plans": [_plan_json(p) for p in plans],
                          "recommended": None if best is None else best.ds_config(),
                          "recommended_plan": None if best is None else _plan_json(best)}, indent=2))
        return 0 if budget is None or best is not None else 1
    if kw["lora"] is not None:
        print(plans[0].notes[0])
    print(f"{shape.name}: {shape.num_params / 1e6:.2f}M parameters; world size {args.world_size}; "
          f"micro-batch {micro} x seq {args.seq_len}; {precision}"
          f"{' mixed precision' if precision != 'fp32' else ''}, Adam"
          f"{'; activation checkpointing' if ckpt else ''}; {args.device}")
    print(f"{'per rank':<28}" + "".join(f"{c:>12}" for c in COLUMNS))
    for p in plans:
        mark = "*" if chosen_stage == p.stage and p.offload == "none" else " "
        print(f"{mark}{p.label:<27}" + "".join(f"{fmt_bytes(v):>12}" for v in _values(p)))
    print("params/grads/optimizer: model states (mixed precision 2 + 2 + 12 bytes per parameter, fp32 4 + 4 + 8), "
          "moved to cpu/nvme by offload; activations: kept for backward + the largest transient (loss or a "
          "block's backward); buffers: stage 2-3 gradient buffers + stage 3 gathered units; step temps: "
          "fp32 gradient copy (mixed precision), stage 1 reduce-scatter output; base+slack: process baseline "
          "and glibc heap slack (cpu); device = peak on the accelerator (host RAM on cpu) = base+slack + "
          "states + max(activations + buffers, step temps + gradient buffers)")
    if budget is not None:
        if best is None:
            print(f"nothing fits a device budget of {fmt_bytes(budget)} per rank (checkpointing and micro-batch "
                  f"down to 1 tried): add ranks or shorten --seq-len")
            return 1
        print(f"recommended for {fmt_bytes(budget)} per rank: {best.description} (device {fmt_bytes(best.device)}"
              f"{f', cpu {fmt_bytes(best.cpu)}' if best.cpu else ''}): {json.dumps(best.ds_config())}")
    return 0
