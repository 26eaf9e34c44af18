"""Multi-LoRA serving: a batch mixing adapters and the base model equals HF + PEFT per request.

Reference: transformers ``generate`` (fp32, greedy) on the same tiny Llama folder with the
adapter attached by ``peft.PeftModel.from_pretrained``; the adapters are random (B not
zero) and saved by PEFT's own ``save_pretrained``.
"""

from __future__ import annotations

import pytest
import torch

from tests.inference.conftest import mixed_prompts
from zeal.config.inference import EngineConfig, LoRAServingConfig
from zeal.inference.engine import LLMEngine
from zeal.inference.lora_adapters import LoRAError
from zeal.inference.sampling_params import SamplingParams
from zeal.models.hf import load_hf_model

NEW = 8
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)


def make_adapter(base_dir, out_dir, seed: int, **lora_kwargs):
    """A random PEFT LoRA adapter over the HF model in ``base_dir``, saved by PEFT to ``out_dir``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    cfg = LoraConfig(init_lora_weights=False, lora_dropout=0.0, **lora_kwargs)
    peft_model = get_peft_model(model, cfg)
    with torch.no_grad():  # PEFT's init_lora_weights=False B is small: make each adapter's effect plain
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 0.3)
    peft_model.save_pretrained(out_dir)
    return out_dir


def peft_greedy(base_dir, adapter_dir, prompts: list[list[int]], new: int = NEW) -> list[list[int]]:
    """Reference tokens: HF generate with the PEFT adapter (None: the base alone)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir).eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            out = model.generate(input_ids=ids, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                 attention_mask=torch.ones_like(ids), eos_token_id=None, pad_token_id=0)
            outs.append(out[0, len(p):].tolist())
    return outs


@pytest.fixture(scope="module")
def adapters(llama_dir, tmp_path_factory):
    """Two adapters of different ranks and targets (one with rsLoRA and a rank pattern)."""
    root = tmp_path_factory.mktemp("adapters")
    a = make_adapter(llama_dir, root / "a", 1, r=4, lora_alpha=8,
                     target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    b = make_adapter(llama_dir, root / "b", 2, r=8, lora_alpha=16, use_rslora=True,
                     target_modules=["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"],
                     rank_pattern={"down_proj": 2})
    return {"a": str(a), "b": str(b)}


def _engine(path, loras: dict[str, str], **kw) -> LLMEngine:
    model, _ = load_hf_model(path, torch.float32)
    lcfg = LoRAServingConfig(enable_lora=True, lora_modules=[f"{k}={v}" for k, v in loras.items()], max_loras=4,
                             max_lora_rank=8)
    return LLMEngine(model.eval(), None, EngineConfig(block_size=4, num_blocks=256, lora=lcfg, **kw))


def _run(engine: LLMEngine, jobs: list[tuple[list[int], str | None]]) -> list[list[int]]:
    for i, (prompt, lora) in enumerate(jobs):
        engine.add_request(str(i), prompt, GREEDY, lora_name=lora)
    done = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                assert o.error is None, o.error
                done[o.request_id] = o.outputs[0].token_ids
    return [done[str(i)] for i in range(len(jobs))]


@pytest.fixture(scope="module")
def reference(llama_dir, adapters):
    prompts = mixed_prompts(11, 3, 3, 14)
    return prompts, {name: peft_greedy(llama_dir, path, prompts) for name, path in
                     [(None, None), ("a", adapters["a"]), ("b", adapters["b"])]}


@pytest.mark.timeout(60)
def test_mixed_batch_matches_peft(llama_dir, adapters, reference, kernels):
    """Requests for adapter a, adapter b and the base model in the same passes each get
    PEFT's greedy tokens for their adapter (and the adapters really change the tokens)."""
    prompts, ref = reference
    assert ref["a"] != ref[None] and ref["b"] != ref[None] and ref["a"] != ref["b"]
    engine = _engine(llama_dir, adapters, max_num_batched_tokens=512)
    jobs = [(p, name) for p in prompts for name in (None, "a", "b")]
    got = _run(engine, jobs)
    assert got == [ref[name][i] for i in range(len(prompts)) for name in (None, "a", "b")]
    assert engine.last_stats.num_seqs >= 0 and engine.runner.lora.num_free_slots == 2


@pytest.mark.timeout(60)
def test_chunked_prefill_and_speculative_match_peft(llama_dir, adapters, reference):
    """Prompts split over passes (SplitFuse) and n-gram speculative verify passes keep each
    row on its request's adapter."""
    prompts, ref = reference
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}
    engine = _engine(llama_dir, adapters, max_num_batched_tokens=7, speculative_config=spec)
    jobs = [(p, name) for p in prompts for name in ("b", None, "a")]
    assert _run(engine, jobs) == [ref[name][i] for i in range(len(prompts)) for name in ("b", None, "a")]


@pytest.mark.timeout(60)
def test_draft_model_speculation_keeps_each_adapter(llama_dir, adapters, reference):
    """A draft model (the base's first layer, no adapter) proposes; the target verifies with
    each request's adapter, so the output is still PEFT's greedy output per adapter."""
    from zeal.inference.draft_model import first_layers

    prompts, ref = reference
    model, _ = load_hf_model(llama_dir, torch.float32)
    draft = first_layers(load_hf_model(llama_dir, torch.float32)[0], 1)
    lcfg = LoRAServingConfig(lora_modules=[f"{k}={v}" for k, v in adapters.items()], max_loras=2, max_lora_rank=8)
    spec = {"method": "draft_model", "model": str(llama_dir), "num_speculative_tokens": 2}
    engine = LLMEngine(model.eval(), None, EngineConfig(block_size=4, num_blocks=128, lora=lcfg,
                                                        speculative_config=spec), draft_model=draft)
    jobs = [(p, name) for p in prompts for name in ("a", "b", None)]
    assert _run(engine, jobs) == [ref[name][i] for i in range(len(prompts)) for name in ("a", "b", None)]
    assert engine.metrics.spec_draft_tokens_total > 0


@pytest.mark.timeout(60)
def test_prefix_cache_does_not_leak_across_adapters(llama_dir, adapters):
    """The same prompt under the base, adapter a and adapter b: each computes its own KV
    (no cross hits), and a repeat under the same adapter hits its own blocks."""
    prompt = mixed_prompts(5, 1, 21, 21)[0]
    ref = {n: peft_greedy(llama_dir, adapters.get(n), [prompt])[0] for n in (None, "a", "b")}
    engine = _engine(llama_dir, adapters, max_num_batched_tokens=64)
    bm = engine.bm
    got = {}
    for name in (None, "a", "b"):
        before = bm.num_prefix_hits
        got[name] = _run(engine, [(prompt, name)])[0]
        assert bm.num_prefix_hits == before, f"{name}: hit blocks cached under another adapter"
    before = bm.num_prefix_hits
    assert _run(engine, [(prompt, "a")])[0] == ref["a"]
    assert bm.num_prefix_hits - before == 5  # (21 - 1) // 4 blocks of its own
    assert got == ref


@pytest.mark.timeout(60)
def test_reloaded_name_never_hits_old_kv(llama_dir, adapters):
    """Unloading a and loading b's folder under the name a: the new a computes afresh (a new
    lora_id salts the hashes), giving b's tokens."""
    prompt = mixed_prompts(6, 1, 17, 17)[0]
    engine = _engine(llama_dir, {"a": adapters["a"]}, max_num_batched_tokens=64)
    _run(engine, [(prompt, "a")])
    engine.unload_lora_adapter("a")
    engine.load_lora_adapter("a", adapters["b"])
    before = engine.bm.num_prefix_hits
    got = _run(engine, [(prompt, "a")])[0]
    assert engine.bm.num_prefix_hits == before
    assert got == peft_greedy(llama_dir, adapters["b"], [prompt])[0]


@pytest.mark.timeout(60)
def test_load_unload_errors(llama_dir, adapters, tmp_path):
    engine = _engine(llama_dir, {"a": adapters["a"]})
    with pytest.raises(LoRAError, match="already loaded") as e:
        engine.load_lora_adapter("a", adapters["b"])
    assert e.value.status == 400
    with pytest.raises(LoRAError, match="no LoRA adapter folder") as e:
        engine.load_lora_adapter("c", str(tmp_path / "missing"))
    assert e.value.status == 404
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "adapter_config.json").write_text("{not json")
    with pytest.raises(LoRAError, match="not valid JSON") as e:
        engine.load_lora_adapter("c", str(tmp_path / "bad"))
    assert e.value.status == 400
    big = make_adapter(llama_dir, tmp_path / "big", 3, r=16, target_modules=["q_proj"])
    with pytest.raises(LoRAError, match="rank 16 exceeds max_lora_rank 8"):
        engine.load_lora_adapter("big", str(big))
    with pytest.raises(LoRAError, match="not loaded") as e:
        engine.unload_lora_adapter("zzz")
    assert e.value.status == 404
    with pytest.raises(ValueError, match="not loaded"):
        engine.add_request("r", [3, 4], GREEDY, lora_name="zzz")
    assert [c["name"] for c in engine.loras.cards()] == ["a"]


@pytest.mark.timeout(60)
def test_unload_in_use_drains(llama_dir, adapters, reference):
    """Unloading an adapter with requests running: they finish with it (PEFT's tokens), new
    requests for the name are refused, and its slot is freed when they end."""
    prompts, ref = reference
    engine = _engine(llama_dir, adapters)
    engine.add_request("x", prompts[0], GREEDY, lora_name="a")
    engine.step()
    assert engine.unload_lora_adapter("a") == 1
    with pytest.raises(ValueError, match="not loaded"):
        engine.add_request("y", prompts[0], GREEDY, lora_name="a")
    assert engine.runner.lora.num_free_slots == 2  # a's slot still held
    out = None
    while engine.has_unfinished():
        out = next((o for o in engine.step() if o.finished), out)
    assert out.outputs[0].token_ids == ref["a"][0]
    assert engine.runner.lora.num_free_slots == 3 and not engine.loras.draining


def _serve_cfg(argv: list[str]):
    from zeal.cli.main import build_parser
    from zeal.cli.serve import config_from_args

    parser, _ = build_parser("serve")
    return config_from_args(parser.parse_args(["serve", "BASE", *argv]))


def test_serve_lora_flags():
    """vLLM's flags: name=path and JSON entries, max_loras / max_lora_rank; bad entries are
    one-line errors at start-up."""
    cfg = _serve_cfg(["--lora-modules", "sql=/a", '{"name": "chat", "path": "/b", "base_model_name": "BASE"}',
                      "--max-loras", "2", "--max-lora-rank", "32", "--allow-runtime-lora-updating"]).engine.lora
    assert [(m.name, m.path) for m in cfg.lora_modules] == [("sql", "/a"), ("chat", "/b")]
    assert cfg.max_loras == 2 and cfg.max_lora_rank == 32 and cfg.allow_runtime_lora_updating and cfg.enabled
    assert not _serve_cfg([]).engine.lora.enabled
    for argv, msg in [(["--lora-modules", "nopath"], "not name=path"),
                      (["--lora-modules", "a=/x", "a=/y"], "given twice"),
                      (["--lora-modules", "a=/x", "b=/y", "--max-loras", "1"], "exceed max_loras 1"),
                      (["--lora-modules", "{bad"], "not valid JSON")]:
        with pytest.raises(ValueError, match=msg):
            _serve_cfg(argv)


def test_refused_configurations(llama_dir, adapters, tmp_path):
    """What multi-LoRA serving does not do is refused in one line: adapters on the output
    head, modules_to_save, an adapter of another base model, tensor parallelism."""
    from zeal.lora.peft_folder import read_adapter, write_adapter

    head = make_adapter(llama_dir, tmp_path / "head", 4, r=2, target_modules=["q_proj", "lm_head"])
    engine = _engine(llama_dir, {})
    with pytest.raises(LoRAError, match="output head"):
        engine.load_lora_adapter("h", str(head))
    saved = make_adapter(llama_dir, tmp_path / "saved", 5, r=2, target_modules=["q_proj"], modules_to_save=["lm_head"])
    with pytest.raises(LoRAError, match="modules_to_save"):
        engine.load_lora_adapter("s", str(saved))
    other = read_adapter(adapters["a"])
    for pair in other.lora.values():
        pair.A = torch.zeros(pair.rank, 7)
    write_adapter(tmp_path / "other", other)
    with pytest.raises(LoRAError, match="another base model"):
        engine.load_lora_adapter("o", str(tmp_path / "other"))
    assert engine.runner.lora.num_free_slots == 4

    class _TP:  # rank 0's group as the engine sees it
        size = 2

        def attach(self, runner):
            pass

    model, _ = load_hf_model(llama_dir, torch.float32)
    with pytest.raises(ValueError, match="LoRA serving is not supported with tensor_parallel_size 2"):
        LLMEngine(model, None, EngineConfig(num_blocks=8, lora=LoRAServingConfig(enable_lora=True)), tp=_TP())


@pytest.mark.timeout(60)
def test_int8_matmul_base_equals_dequantized_base(llama_dir, adapters, reference):
    """With the base's linears computing by int8 weight-only matmuls (quantized_matmul), each
    request gets the tokens of the dequantized base plus its adapter."""
    from zeal.inference.quant_linear import Int8Linear, int8_supported

    if not int8_supported(64, torch.float32, torch.device("cpu")):
        pytest.skip("torch._weight_int8pack_mm unavailable")
    qmodel, _ = load_hf_model(llama_dir, torch.float32)
    dmodel, _ = load_hf_model(llama_dir, torch.float32)
    with torch.no_grad():
        for ql, dl in zip(qmodel.model.layers, dmodel.model.layers):
            for part in ("self_attn", "mlp"):
                for name, lin in list(getattr(ql, part).named_children()):
                    if not isinstance(lin, torch.nn.Linear):
                        continue
                    w = lin.weight
                    scales = w.abs().amax(1) / 127
                    codes = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
                    setattr(getattr(ql, part), name, Int8Linear(codes, scales, lin.bias, torch.float32))
                    getattr(getattr(dl, part), name).weight.copy_(codes.float() * scales[:, None])
    prompts, _ = reference
    jobs = [(p, name) for p in prompts for name in ("a", None, "b")]
    lcfg = LoRAServingConfig(lora_modules=[f"{k}={v}" for k, v in adapters.items()], max_loras=2, max_lora_rank=8)
    got = [_run(LLMEngine(m.eval(), None, EngineConfig(block_size=4, num_blocks=128, lora=lcfg)), jobs)
           for m in (qmodel, dmodel)]
    assert got[0] == got[1]
    assert got[0][0] != got[0][1]  # adapter a changed the tokens
