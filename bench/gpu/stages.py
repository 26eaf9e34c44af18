"""The stages of ``bench/gpu/run.sh``: each prints one JSON line (``{"stage": ..., ...}``).

    python bench/gpu/stages.py STAGE [--dry-run]      # env, train_correct, train_speed, serve_correct, serve_speed
    python bench/gpu/stages.py report results.jsonl   # the table of a run

On a GPU the models have real shapes (SmolLM2-135M and Llama-3.2-1B, random weights from
their configs: nothing is downloaded); ``--dry-run`` runs every stage on the CPU at toy
sizes, so CI keeps the script working on the days no GPU is lent. A case that fails is
recorded with its one-line error and the stage goes on: the run is a report, not a test.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_modes import decode_modes  # noqa: E402 - async scheduling / compiled decode rows

# HBM bandwidth in TB/s (vendor figures): the decode step's floor; the FLOP peaks are zeal.utils.flops'
HBM_TBPS = {"H100": 3.35, "H200": 4.8, "A100": 2.0, "L40S": 0.864}
SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, tie_word_embeddings=True,
               rope_theta=100000.0)
LLAMA_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                tie_word_embeddings=True, rope_theta=500000.0)
TOY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False)


def _device(dry: bool):
    import torch

    return torch.device("cpu") if dry or not torch.cuda.is_available() else torch.device("cuda", 0)


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak(device) -> float | None:
    import torch

    return round(torch.cuda.max_memory_allocated(device) / 2**30, 3) if device.type == "cuda" else None


def _free(device) -> None:
    """Give back a dropped engine's memory (its KV cache was sized from the free memory):
    the engine holds reference cycles (decode-graph closures), so collect them first."""
    import gc

    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _reset_peak(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _partial(stage: str, dry: bool, rec: dict) -> None:
    """Print the stage's record so far: run.sh keeps the last line a stage printed, so a stage
    stopped at its time limit still reports what it measured (marked ``partial``)."""
    print(json.dumps({"stage": stage, "dry_run": dry, "partial": True} | rec), flush=True)


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]


_BUILT: dict = {}


def _hf_llama(shape: dict, layers: int | None = None, seed: int = 0):
    """A fresh Hugging Face Llama of this shape, random weights from ``seed``: built once per
    process (random initialisation is most of a toy stage's model cost, and seconds per copy
    of the 1B model), then copied for each caller."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    key = (json.dumps(shape, sort_keys=True), layers, seed)
    if key not in _BUILT:
        torch.manual_seed(seed)
        _BUILT[key] = LlamaForCausalLM(LlamaConfig(**(shape | ({"num_hidden_layers": layers} if layers else {}))))
    return copy.deepcopy(_BUILT[key])


def _zeal_llama(shape: dict, seed: int = 0):
    """zeal's own Llama of this shape (no transformers import: the smoke step stays cheap)."""
    import torch

    from zeal.models.llama import Llama, LlamaConfig

    torch.manual_seed(seed)
    return Llama(LlamaConfig(**shape))


# ------------------------------------------------------------------ stages
def stage_env(dry: bool) -> dict:
    import importlib.util

    import torch

    out: dict = {"torch": torch.__version__, "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
                 "python": sys.version.split()[0]}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        out |= {"device": p.name, "capability": f"{p.major}.{p.minor}", "memory_gib": round(p.total_memory / 2**30, 1),
                "device_count": torch.cuda.device_count(), "bf16": torch.cuda.is_bf16_supported()}
    out["packages"] = {m: importlib.util.find_spec(m) is not None for m in (
        "transformers", "triton", "flash_attn", "vllm", "pydantic", "safetensors", "tokenizers", "numpy", "yaml")}
    device = _device(dry)
    try:  # the smoke step: zeal imports and trains one step of its own Llama on the device
        import zeal

        engine = zeal.initialize(_zeal_llama(TOY).to(device), {"train_micro_batch_size_per_gpu": 2,
                                                                "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
        x = torch.randint(0, TOY["vocab_size"], (2, 16), device=device)
        loss = engine(input_ids=x, labels=x)
        engine.backward(loss)
        engine.step()
        out["smoke_step"] = {"ok": True, "loss": round(float(loss.detach()), 4), "device": str(engine.device)}
    except Exception as e:  # noqa: BLE001 - reported
        out["smoke_step"] = {"ok": False, "error": _err(e)}
    return out


def _train_losses(model, config: dict | None, batches, device, precision: str = "fp32") -> list[float]:
    """Per-step losses: zeal under ``config``, or plain PyTorch AdamW when ``config`` is None."""
    import torch

    if config is None:
        model = model.to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
        losses = []
        for x in batches:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
                loss = model(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(loss))
        return losses
    import zeal

    engine = zeal.initialize(model.to(device), config)
    losses = []
    for x in batches:
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    return losses


def stage_train_correct(dry: bool) -> dict:
    """World size 1: ZeRO stages 0-3 (fp32) against plain PyTorch; bf16, checkpointing,
    cpu_checkpointing, CPU optimizer offload and the NVMe tiers against the fp32 reference."""
    import torch

    device = _device(dry)
    shape, layers, steps, seq = (TOY, None, 3, 32) if dry else (SMOLLM2, 4, 5, 256)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, shape["vocab_size"], (4, seq), generator=gen).to(device) for _ in range(steps)]
    ref = _train_losses(_hf_llama(shape, layers), None, batches, device)
    opt = {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}}
    base = {"train_micro_batch_size_per_gpu": 4, "optimizer": opt}
    nvme = tempfile.mkdtemp(prefix="zeal-gpu-nvme-")
    cases = {f"stage{s}": (base | {"zero_optimization": {"stage": s}}, 1e-5) for s in range(4)}
    cases |= {
        "stage3_bf16": (base | {"bf16": {"enabled": True}, "zero_optimization": {"stage": 3}}, 3e-2),
        "stage3_checkpointing": (base | {"zero_optimization": {"stage": 3}, "activation_checkpointing": {}}, 1e-5),
        "stage3_cpu_checkpointing": (base | {"zero_optimization": {"stage": 3},
                                             "activation_checkpointing": {"cpu_checkpointing": True}}, 1e-5),
        "stage2_offload_optimizer_cpu": (base | {"zero_optimization": {"stage": 2, "offload_optimizer": {
            "device": "cpu", "pin_memory": True}}}, 1e-5),
        "stage3_offload_optimizer_nvme": (base | {"zero_optimization": {"stage": 3, "offload_optimizer": {
            "device": "nvme", "nvme_path": nvme}}}, 1e-5),
        "stage3_offload_param_nvme": (base | {"zero_optimization": {"stage": 3, "offload_param": {
            "device": "nvme", "nvme_path": nvme}}}, 1e-5),
        # parameters in (pinned) host memory, uploaded before each gather; with and without the CPU optimizer
        "stage3_offload_param_cpu": (base | {"zero_optimization": {"stage": 3, "offload_param": {
            "device": "cpu", "pin_memory": True}}}, 1e-5),
        "stage3_offload_param_cpu_optimizer_cpu": (base | {"zero_optimization": {"stage": 3, "offload_param": {
            "device": "cpu", "pin_memory": True}, "offload_optimizer": {"device": "cpu", "pin_memory": True}}}, 1e-5),
        "stage3_offload_all_nvme": (base | {"zero_optimization": {"stage": 3, "offload_param": {
            "device": "nvme", "nvme_path": nvme}, "offload_optimizer": {"device": "nvme", "nvme_path": nvme}}}, 1e-5),
        "stage3_bf16_offload_optimizer_cpu": (base | {"bf16": {"enabled": True}, "zero_optimization": {
            "stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True}}}, 3e-2),
        # ZeRO-Offload++: half the units' optimizer on the host, the rest on the device
        "stage3_offload_optimizer_cpu_ratio_0.5": (base | {"zero_optimization": {"stage": 3, "offload_optimizer": {
            "device": "cpu", "pin_memory": True, "ratio": 0.5}}}, 1e-5),
    }
    if dry:  # the CPU has no device/host boundary: run the staging path anyway, as on the GPU
        from zeal.zero.offload import staging

        staging.FORCE_CROSSING = True
    results = {}
    for name, (cfg, tol) in cases.items():
        t = time.perf_counter()
        try:
            got = _train_losses(_hf_llama(shape, layers), cfg, batches, device)
            diff = max(abs(a - b) / abs(b) for a, b in zip(got, ref))
            results[name] = {"ok": diff <= tol, "max_rel_diff": float(f"{diff:.3g}"), "tol": tol,
                             "s": round(time.perf_counter() - t, 1)}
        except Exception as e:  # noqa: BLE001 - reported
            results[name] = {"ok": False, "error": _err(e)}
        _partial("train_correct", dry, {"device": str(device), "cases": results})
    return {"device": str(device), "reference_losses": [round(x, 4) for x in ref], "cases": results}


def _time_steps(step, device, warmup: int, steps: int) -> float:
    for _ in range(warmup):
        step()
    _sync(device)
    t = time.perf_counter()
    for _ in range(steps):
        step()
    _sync(device)
    return (time.perf_counter() - t) / steps


def stage_train_speed(dry: bool) -> dict:
    """Tokens/s, MFU and peak memory per step: plain PyTorch (eager, compiled), FSDP2 at world
    size 1, zeal stages 0 and 3 (bf16; eager and with the config's ``compile`` key)."""
    import torch

    device = _device(dry)
    shape, micro, seq, warmup, steps = (TOY, 2, 64, 1, 2) if dry else (LLAMA_1B, 4, 1024, 3, 8)
    from zeal.utils.flops import peak_flops

    peak, peak_src = peak_flops(device.type, device.index or 0)
    x = torch.randint(0, shape["vocab_size"], (micro, seq), device=device)
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):  # counted without initialising a second 1B model (nor caching a meta one)
        n_params = sum(p.numel() for p in LlamaForCausalLM(LlamaConfig(**shape)).parameters())
    flops_per_step = 6 * n_params * micro * seq  # + attention: 12·layers·hidden·seq² per sequence
    flops_per_step += 12 * shape["num_hidden_layers"] * shape["hidden_size"] * seq * seq * micro
    results = {}

    def plain(compiled: bool):
        model = _hf_llama(shape).to(device)
        fwd = torch.compile(model) if compiled else model
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")

        def step():
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = fwd(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step

    def fsdp2():
        import torch.distributed as dist
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if not dist.is_initialized():
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "29533")
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
        model = _hf_llama(shape).to(device)
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step():
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step

    def zeal_engine(stage: int, compiled: bool):
        import zeal

        cfg = {"train_micro_batch_size_per_gpu": micro, "bf16": {"enabled": True},
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": {"stage": stage}}
        if compiled:
            cfg["compile"] = {"enabled": True}
        engine = zeal.initialize(_hf_llama(shape).to(device), cfg)

        def step():
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()
        return step

    # the compiled runs last: their compilation is the slowest part, and a stage that runs out of
    # time keeps the runs done so far (each one prints the stage's record so far)
    runs = {"plain_eager": lambda: plain(False), "fsdp2": fsdp2,
            "zeal_stage0": lambda: zeal_engine(0, False), "zeal_stage3": lambda: zeal_engine(3, False),
            "plain_compiled": lambda: plain(True),
            "zeal_stage0_compiled": lambda: zeal_engine(0, True), "zeal_stage3_compiled": lambda: zeal_engine(3, True)}
    head = {"device": str(device), "params": n_params, "micro": micro, "seq": seq, "peak_flops": peak,
            "peak_source": peak_src}
    for name, make in runs.items():
        if dry and "compiled" in name:  # inductor's compile of the toy model alone takes ~30 s on the CPU
            results[name] = {"skipped": "dry run"}
            continue
        _reset_peak(device)
        try:
            dt = _time_steps(make(), device, warmup, steps)
            results[name] = {"step_s": round(dt, 4), "tokens_per_s": round(micro * seq / dt, 1),
                             "mfu": round(flops_per_step / dt / peak, 4) if peak else None, "peak_gib": _peak(device)}
        except Exception as e:  # noqa: BLE001 - reported
            results[name] = {"error": _err(e)}
        _partial("train_speed", dry, head | {"runs": results})
    return head | {"runs": results}


def _saved_model(shape: dict, layers: int | None, dtype) -> tuple[str, object]:
    model = _hf_llama(shape, layers).to(dtype).eval()
    path = tempfile.mkdtemp(prefix="zeal-gpu-model-")
    model.save_pretrained(path)
    return path, model


def stage_serve_correct(dry: bool) -> dict:
    """fp32 greedy tokens of zeal's engine equal Hugging Face ``generate``; bf16 prompt logits."""
    import torch

    from zeal.inference import LLM, SamplingParams

    device = _device(dry)
    shape, layers, n_new = (TOY, None, 8) if dry else (SMOLLM2, None, 32)
    path, hf = _saved_model(shape, layers, torch.float32)
    hf = hf.to(device)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, shape["vocab_size"], (n,), generator=gen).tolist() for n in (5, 17, 33, 64)]
    out: dict = {"device": str(device)}
    got = None
    try:
        llm = LLM(path, dtype=torch.float32, device=str(device))
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(
            max_tokens=n_new, temperature=0.0, ignore_eos=True))]
        same = 0
        for p, g in zip(prompts, got):
            ref = hf.generate(torch.tensor([p], device=device), max_new_tokens=n_new, min_new_tokens=n_new,
                              do_sample=False)[0, len(p):].tolist()
            same += int(ref == list(g))
        out["fp32_greedy_equal"] = f"{same}/{len(prompts)}"
        out |= _serving_path(llm)
        llm.shutdown()
        del llm
        _free(device)
    except Exception as e:  # noqa: BLE001 - reported
        out["fp32_greedy_equal"] = _err(e)
    _partial("serve_correct", dry, out)
    if dry:  # the accelerator's serving path (flex paged attention, packed inputs, decode graphs) on the CPU
        out["flex_path_greedy_equal"] = _flex_path_on_cpu(path, prompts, got, n_new)
    try:
        llm = LLM(path, dtype=torch.bfloat16, device=str(device))
        p = prompts[-1]
        o = llm.generate([p], SamplingParams(max_tokens=1, temperature=0.0, logprobs=5, prompt_logprobs=1))[0]
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([p], device=device)).logits[0].float(), -1)
        # entry i scores prompt token i from the logits at position i - 1
        diffs = [abs(e["logprob"] - float(ref[i - 1, e["token"]])) for i, e in enumerate(o.prompt_logprobs or [])
                 if e is not None]
        out["bf16_prompt_logprob_max_abs_diff"] = round(max(diffs), 4) if diffs else "no prompt logprobs"
        llm.shutdown()
        llm = None
        _free(device)
    except Exception as e:  # noqa: BLE001 - reported
        out["bf16_prompt_logprob_max_abs_diff"] = _err(e)
    return out


def stage_serve_speed(dry: bool) -> dict:
    """Generated tokens/s on one workload: zeal's engine vs HF ``generate`` in static batches;
    zeal's decode step against the weight-bytes / HBM-bandwidth floor; a profile of decode steps."""
    import torch

    from zeal.inference import LLM, SamplingParams

    device = _device(dry)
    dtype = torch.float32 if dry else torch.bfloat16
    shape, n_req, p_len, n_new, hf_batch = (TOY, 4, 16, 8, 2) if dry else (SMOLLM2, 64, 256, 128, 32)
    path, hf = _saved_model(shape, None, dtype)
    hf = hf.to(device)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, shape["vocab_size"], (p_len,), generator=gen).tolist() for _ in range(n_req)]
    params = SamplingParams(max_tokens=n_new, temperature=0.0, ignore_eos=True)
    out: dict = {"device": str(device), "requests": n_req, "prompt_len": p_len, "new_tokens": n_new}
    weight_bytes = sum(p.numel() * p.element_size() for p in hf.parameters())
    try:
        llm = LLM(path, dtype=dtype, device=str(device))
        llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))  # warm-up
        _sync(device)
        t = time.perf_counter()
        llm.generate(prompts, params)
        _sync(device)
        dt = time.perf_counter() - t
        out["zeal_tokens_per_s"] = round(n_req * n_new / dt, 1)
        # one request decoding alone: the decode step time against reading every weight once
        one = SamplingParams(max_tokens=n_new, temperature=0.0, ignore_eos=True)
        t = time.perf_counter()
        llm.generate([prompts[0]], one)
        _sync(device)
        step = (time.perf_counter() - t) / n_new
        out["zeal_decode_step_ms"] = round(step * 1e3, 3)
        out["decode_batch"], out["zeal_decode_step_ms_at_batch"] = n_req, _decode_step_ms(llm, prompts, n_new, device)
        if device.type == "cuda":
            bw = next((b for k, b in HBM_TBPS.items() if k in torch.cuda.get_device_name(device)), None)
            if bw:
                out["decode_floor_ms"] = round(weight_bytes / (bw * 1e12) * 1e3, 3)
                out["decode_at_batch_over_floor"] = round(out["zeal_decode_step_ms_at_batch"] / out["decode_floor_ms"], 2)
        out["profile"] = _profile_decode(llm, prompts[0], device)
        out |= _serving_path(llm)
        llm.shutdown()
        llm = None
        _free(device)
        _partial("serve_speed", dry, out)
        if device.type == "cuda":  # the same workload without decode graphs
            llm = LLM(path, dtype=dtype, device=str(device), enforce_eager=True)
            llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
            _sync(device)
            t = time.perf_counter()
            llm.generate(prompts, params)
            _sync(device)
            out["zeal_eager_tokens_per_s"] = round(n_req * n_new / (time.perf_counter() - t), 1)
            llm.shutdown()
            llm = None
            _free(device)
    except Exception as e:  # noqa: BLE001 - reported
        out["zeal_error"] = _err(e)
    out["decode_modes"] = decode_modes(path, dtype, device, prompts, params, dry, _sync, _free, _err)
    _partial("serve_speed", dry, out)
    try:
        total, t = 0, time.perf_counter()
        for i in range(0, n_req, hf_batch):
            batch = torch.tensor(prompts[i:i + hf_batch], device=device)
            hf.generate(batch, max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False)
            total += batch.shape[0] * n_new
        _sync(device)
        out["hf_generate_tokens_per_s"] = round(total / (time.perf_counter() - t), 1)
    except Exception as e:  # noqa: BLE001 - reported
        out["hf_error"] = _err(e)
    if out.get("zeal_tokens_per_s") and out.get("hf_generate_tokens_per_s"):
        out["zeal_over_hf"] = round(out["zeal_tokens_per_s"] / out["hf_generate_tokens_per_s"], 2)
    return out


def _serving_path(llm) -> dict:
    """Which serving path the engine took: attention backend, packed step inputs, decode graphs."""
    r = llm.engine.runner
    out = {"attention": type(r.attn_backend).__name__ if r.attn_backend is not None else
           ("cpu_kernels" if r.kernels is not None else "torch_reference"),
           "packed_step_inputs": r.packer is not None}
    if r.graphs is not None:
        out["decode_graphs"] = dict(r.graphs.stats) | {"buckets_captured": sorted(r.graphs.graphs)}
    return out


def _flex_path_on_cpu(path: str, prompts: list, ref, n_new: int) -> str:
    """Greedy tokens through the accelerator's path run on the CPU (flex attention, packed
    inputs, decode graphs with a fake graph) against the default CPU path's."""
    import torch

    from zeal.inference import LLM, SamplingParams
    from zeal.inference.cuda_graphs import FakeGraph

    if ref is None:
        return "no reference tokens"
    old = os.environ.get("ZEAL_ATTENTION_BACKEND")
    os.environ["ZEAL_ATTENTION_BACKEND"] = "flex"
    try:
        # eager flex_attention scores every query against the whole cache: a small one
        llm = LLM(path, dtype=torch.float32, device="cpu", num_blocks=64, block_size=16)
        llm.engine.runner.enable_decode_graphs(8, llm.engine.max_seq_tokens, graph_factory=FakeGraph)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(
            max_tokens=n_new, temperature=0.0, ignore_eos=True))]
        llm.shutdown()
        return f"{sum(int(list(a) == list(b)) for a, b in zip(got, ref))}/{len(prompts)}"
    except Exception as e:  # noqa: BLE001 - reported
        return _err(e)
    finally:
        if old is None:
            os.environ.pop("ZEAL_ATTENTION_BACKEND", None)
        else:
            os.environ["ZEAL_ATTENTION_BACKEND"] = old


def _decode_step_ms(llm, prompts: list, n_new: int, device) -> float:
    """Median time of the decode-only engine steps with every request of ``prompts`` decoding."""
    import statistics

    from zeal.inference import SamplingParams

    eng = llm.engine
    for i, p in enumerate(prompts):
        eng.add_request(f"decode-bench-{i}", p, SamplingParams(max_tokens=n_new, temperature=0.0, ignore_eos=True))
    times = []
    while eng.has_unfinished():
        _sync(device)
        t = time.perf_counter()
        eng.step()
        _sync(device)
        st = eng.last_stats
        if st.num_prompt_tokens == 0 and st.num_decode_tokens == len(prompts):
            times.append(time.perf_counter() - t)
    return round(statistics.median(times) * 1e3, 3) if times else float("nan")


def _profile_decode(llm, prompt: list[int], device) -> dict:
    """Kernels (or CPU ops), host and device milliseconds and synchronising calls per decode step."""
    from torch.profiler import ProfilerActivity, profile

    from zeal.inference import SamplingParams

    n = 8
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        llm.generate([prompt], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    events = prof.key_averages()
    kernels = sum(e.count for e in events if getattr(e, "device_type", None) is not None
                  and str(e.device_type).endswith("CUDA"))
    syncs = sum(e.count for e in events if any(k in e.key for k in ("Synchronize", "aten::item",
                                                                     "aten::_local_scalar_dense", "cudaMemcpy")))
    host_ms = sum(e.self_cpu_time_total for e in events) / 1e3
    dev_ms = sum(getattr(e, "self_device_time_total", 0) for e in events) / 1e3
    return {"steps": n, "kernels_per_step": round(kernels / n, 1), "host_syncs_per_step": round(syncs / n, 1),
            "host_ms_per_step": round(host_ms / n, 3), "device_ms_per_step": round(dev_ms / n, 3)}


STAGES = {"env": stage_env, "train_correct": stage_train_correct, "train_speed": stage_train_speed,
          "serve_correct": stage_serve_correct, "serve_speed": stage_serve_speed}


def report(path: str) -> None:
    """The results file as a short table, one stage a block."""
    for line in Path(path).read_text().splitlines():
        rec = json.loads(line)
        print(f"== {rec['stage']} ({rec.get('seconds', '?')} s){' ERROR ' + rec['error'] if 'error' in rec else ''}"
              f"{' PARTIAL: stopped at its time limit' if rec.get('partial') else ''}")
        for k, v in rec.items():
            if k in ("stage", "seconds", "error", "partial"):
                continue
            if isinstance(v, dict) and all(isinstance(x, dict) for x in v.values()):
                for name, row in v.items():
                    print(f"   {name:32s} {json.dumps(row)}")
            else:
                print(f"   {k}: {json.dumps(v)}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stage", choices=[*STAGES, "report"])
    ap.add_argument("path", nargs="?", help="results.jsonl (report)")
    ap.add_argument("--dry-run", action="store_true", help="on the CPU at toy sizes")
    a = ap.parse_args(argv)
    if a.stage == "report":
        report(a.path)
        return 0
    t = time.perf_counter()
    # the stage's scratch folders (saved models, NVMe swap) go under one folder removed at its end
    with tempfile.TemporaryDirectory(prefix=f"zeal-gpu-{a.stage}-") as scratch:
        tempfile.tempdir = scratch
        try:
            rec = {"stage": a.stage, "dry_run": a.dry_run} | STAGES[a.stage](a.dry_run)
        except Exception as e:  # noqa: BLE001 - the stage's own failure, reported as its line
            traceback.print_exc()
            rec = {"stage": a.stage, "dry_run": a.dry_run, "error": _err(e)}
        finally:
            tempfile.tempdir = None
    rec["seconds"] = round(time.perf_counter() - t, 1)
    print(json.dumps(rec), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
