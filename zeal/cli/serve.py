"""``zeal serve [PATH]``: the OpenAI-compatible server (default model: SmolLM2-135M-Instruct)."""

from __future__ import annotations

import argparse
import logging
import sys

DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16", "auto": "auto"}


def cpu_has_native_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU multiplies bf16 in hardware (x86 AVX512-BF16 or AMX-BF16, Arm BF16)."""
    from zeal.inference.kernels import cpu_flags

    return bool(cpu_flags(cpuinfo) & {"avx512_bf16", "amx_bf16", "bf16"})


def resolve_dtype(name: str, device: str) -> str:
    """``auto``: bfloat16 where the hardware computes it natively (a CUDA GPU with bf16, a
    CPU with bf16 dot products), float32 elsewhere; any other name as given."""
    name = DTYPES[name]
    if name != "auto":
        return name
    import torch

    if device.startswith("cuda"):
        return "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "float16"
    return "bfloat16" if device == "cpu" and cpu_has_native_bf16() else "float32"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help="HF folder (config.json + safetensors) or .gguf file; default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every route but /health")
    p.add_argument("--served-model-name", default=None, help="model id reported by /v1/models")
    p.add_argument("--dtype", default="auto", choices=sorted(DTYPES),
                   help="weights and compute; auto (default): bfloat16 where the CPU/GPU computes it natively, "
                        "else float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--block-size", type=int, default=None,
                   help="tokens per KV-cache block (default: 64 on CPU, 16 on accelerators)")
    p.add_argument("--num-blocks", type=int, default=None, help="KV-cache blocks (default: from --kv-cache-mb)")
    p.add_argument("--kv-cache-mb", type=int, default=512, help="KV-cache memory when --num-blocks is not given")
    p.add_argument("--max-num-batched-tokens", type=int, default=512, help="SplitFuse token budget per forward pass")
    p.add_argument("--max-num-seqs", type=int, default=64, help="sequences per forward pass")
    p.add_argument("--max-model-len", type=int, default=None, help="cap on prompt + completion tokens")
    p.add_argument("--max-waiting", type=int, default=256, help="bounded waiting queue; beyond it: HTTP 429")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--log-level", default="info")


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``serve`` on an argparse subparsers object."""
    p = subparsers.add_parser("serve", help="serve a model over the OpenAI HTTP API",
                              description=__doc__)
    add_arguments(p)
    p.set_defaults(func=run)
    return p


def build(args: argparse.Namespace):
    """Load the model and return ``(app, model_name)``."""
    from pathlib import Path

    import torch

    from zeal.inference.async_engine import AsyncEngine
    from zeal.inference.engine import EngineConfig, LLMEngine
    from zeal.inference.llm import load_model_and_tokenizer, resolve_model_path
    from zeal.inference.server import build_app

    if args.threads:
        torch.set_num_threads(args.threads)
    path = resolve_model_path(args.model)
    model, tok, eos = load_model_and_tokenizer(path, getattr(torch, resolve_dtype(args.dtype, args.device)), args.device)
    cfg = EngineConfig(block_size=args.block_size, num_blocks=args.num_blocks, kv_cache_bytes=args.kv_cache_mb << 20,
                       max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                       max_model_len=args.max_model_len, enable_prefix_caching=not args.no_prefix_caching)
    engine = LLMEngine(model, tok, cfg, eos)
    name = args.served_model_name or (Path(args.model).name if args.model else "SmolLM2-135M-Instruct")
    return build_app(AsyncEngine(engine, args.max_waiting), name, args.api_key), name


def run(args: argparse.Namespace) -> int:
    """Serve until interrupted (Ctrl-C cancels requests in flight and exits cleanly)."""
    import uvicorn

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        app, name = build(args)
    except (FileNotFoundError, ValueError) as e:
        print(f"zeal serve: {e}", file=sys.stderr)
        return 2
    print(f"zeal serve: {name} on http://{args.host}:{args.port}/v1", file=sys.stderr)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="zeal serve", description=__doc__)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
