"""DeepSpeed-Ulysses sequence parallelism (``"sequence_parallel_size": S``) on real gloo
ranks equals one process training on the same full sequences.

Reference: one process, the same initial model, plain SGD (lr 0.5, no momentum) on the
full sequences with the model's own loss (mean next-token cross-entropy, -100 ignored).
Every sp rank passes the same full sequences; zeal shards them. Per step the losses must
agree to 1e-5 relative and the gradients, read as (params before - params after) / lr,
to 1e-5 relative norm-wise plus the rounding of that read (ulp(param) / lr; fp32: all-to-alls only move values, so the only differences
are summation order in the loss's chunked sum and in attention's gathered matmuls — a
chunk attending locally or a label shifted after sharding is off by ~1e-1).
Bytes over ``sp`` equal the Ulysses formula: per attention layer 4 all-to-alls of
b·s·h/S elements forward and 4 backward (GQA's k/v: of b·s·max(nkv, S)·hd/S).
"""

from __future__ import annotations

import pytest
import torch

from tests.dist_harness import run_ranks

pytestmark = pytest.mark.timeout(180)

VOCAB, HIDDEN, LAYERS, MICRO, STEPS, LR = 48, 32, 2, 2, 2, 0.5


def build(kind: str, seq: int) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "hf_llama":  # Hugging Face Llama, GQA (4 query heads, 2 kv heads)
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64,
                                            num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                                            max_position_embeddings=seq, attn_implementation="sdpa"))
    if kind in ("qwen2", "mistral"):  # Hugging Face Qwen2 (q/k/v biases) and Mistral, GQA
        from transformers import AutoConfig, AutoModelForCausalLM

        cfg = AutoConfig.for_model(kind, vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64,
                                   num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=seq, attn_implementation="sdpa")
        return AutoModelForCausalLM.from_config(cfg)
    if kind == "llama":  # zeal's Llama, GQA with 2 kv heads: fewer than S = 4
        from zeal.models.llama import Llama, LlamaConfig

        return Llama(LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=LAYERS,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq))
    from zeal.models.gpt import GPT, GPTConfig

    return GPT(GPTConfig(vocab_size=VOCAB, n_positions=seq, n_embd=HIDDEN, n_layer=LAYERS, n_head=4))


def batches(seq: int, pad: bool, steps: int = STEPS) -> tuple[torch.Tensor, torch.Tensor]:
    """ids[step] and labels[step] (MICRO, seq); with ``pad`` the second sequence ends in 5
    padding tokens and a few labels are -100."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, VOCAB, (steps, MICRO, seq), generator=g)
    labels = ids.clone()
    if pad:
        ids[:, 1, -5:] = 0
        labels[:, 1, -5:] = -100
        labels[:, 0, 3:5] = -100
    return ids, labels


def loss_of(out) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out.loss


def reference(kind: str, seq: int, pad: bool, steps: int = STEPS, final: dict | None = None) -> tuple[list, list]:
    model = build(kind, seq)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    ids, labels = batches(seq, pad, steps)
    losses, grads = [], []
    for s in range(steps):
        loss = loss_of(model(input_ids=ids[s], labels=labels[s]))
        loss.backward()
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    if final is not None:
        final.update(model.state_dict())
    return losses, grads


def config(sp: int, stage: int, tp: int = 1, ckpt: bool = False) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "SGD", "params": {"lr": LR}}, "sequence_parallel_size": sp,
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 3000,
                                 "stage3_param_persistence_threshold": 50}}
    if tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": tp}
    if ckpt:
        cfg["activation_checkpointing"] = {}
    return cfg


def train(kind: str, seq: int, pad: bool, cfg: dict) -> dict:
    import zeal

    engine = zeal.initialize(build(kind, seq), cfg)
    ids, labels = batches(seq, pad)
    losses, grads = [], []
    before = engine.module_state_dict()
    for s in range(STEPS):
        loss = loss_of(engine(input_ids=ids[s], labels=labels[s]))
        engine.backward(loss)
        engine.step()
        after = engine.module_state_dict()
        eps = torch.finfo(torch.float32).eps
        grads.append({n: ((before[n] - after[n]) / LR, float(((before[n].abs() + after[n].abs()) * eps / LR).norm()))
                      for n in after if n in before and after[n].is_floating_point()})
        before = after
        losses.append(loss.item())
    stats = {k: vars(c) for k, c in engine.mesh.stats.last_step.items()}
    sizes = dict(engine.mesh.sizes)
    engine.close()
    return {"losses": losses, "grads": grads, "stats": stats, "sizes": sizes}


def _ranks(rank: int, world: int, cases: list) -> list[dict]:
    return [train(kind, seq, pad, cfg) for kind, seq, pad, cfg in cases]


def check(got: dict, ref: tuple, tag: str) -> None:
    losses, grads = ref
    assert got["losses"] == pytest.approx(losses, rel=1e-5), tag
    for s, g in enumerate(grads):
        for name, want in g.items():
            if name not in got["grads"][s]:
                continue  # a tied alias (GPT's lm_head)
            have, rounding = got["grads"][s][name]
            # 1e-5 relative, plus the rounding of reading the gradient from fp32 parameters
            err = float((torch.as_tensor(have) - want).norm())
            assert err < 1e-5 * float(want.norm()) + rounding, \
                f"{tag}: step {s} gradient of {name} off by {err / float(want.norm()):.2e} relative"


def ulysses_bytes(stats: dict, world: int) -> int:
    """Logical elements the all-to-alls of the step moved over sp."""
    return sum(c["logical_elems"] for (op, kind, dim), c in stats.items()
               if dim == "sp" and op == "all_to_all" and kind == "sequence")


def test_sp2_equals_one_process_gpt_llama_hf_zero3_and_ulysses_volume():
    """SP 2 on 2 ranks: zeal GPT (ZeRO 1), zeal Llama (ZeRO 3, seq 13: padded to 14,
    padding + ignore-index), HF Llama (ZeRO 3) — each equal to one process; the all-to-all
    volume of GPT's step equals the Ulysses formula."""
    cases = [("gpt", 16, False, config(2, 1)), ("llama", 13, True, config(2, 3)),
             ("hf_llama", 16, True, config(2, 3))]
    out = run_ranks(_ranks, 2, cases, timeout=150)
    for i, (kind, seq, pad, _) in enumerate(cases):
        ref = reference(kind, seq, pad)
        for r in range(2):
            check(out[r][i], ref, f"{kind} sp2 rank {r}")
    # GPT: per layer 4 all-to-alls of b·(s/S)·h forward + 4 backward, S = 2 chunks of 8
    assert ulysses_bytes(out[0][0]["stats"], 2) == LAYERS * 8 * MICRO * (16 // 2) * HIDDEN
    assert out[0][0]["sizes"]["sp"] == 2 and out[0][0]["sizes"]["dp"] == 2


@pytest.mark.slow
def test_sp4_gqa_kv_heads_fewer_than_sp_and_act_checkpointing():
    """SP 4 on 4 ranks: zeal Llama with 2 kv heads (< S: replicated) under ZeRO 1 and with
    activation checkpointing under ZeRO 3; zeal GPT at a length S does not divide; HF Llama."""
    cases = [("llama", 16, False, config(4, 1)), ("llama", 16, True, config(4, 3, ckpt=True)),
             ("gpt", 14, True, config(4, 3)), ("hf_llama", 16, False, config(4, 1))]
    out = run_ranks(_ranks, 4, cases, timeout=170)
    for i, (kind, seq, pad, _) in enumerate(cases):
        ref = reference(kind, seq, pad)
        for r in range(4):
            check(out[r][i], ref, f"{kind} sp4 case {i} rank {r}")
    # Llama at S = 4: q and out are b·s·h/S; k and v are replicated to 4 heads of hd 8
    hd, b, s = HIDDEN // 4, MICRO, 16
    per_layer = 2 * b * s * HIDDEN // 4 + 2 * b * s * 4 * hd // 4
    assert ulysses_bytes(out[0][0]["stats"], 4) == LAYERS * 2 * per_layer


@pytest.mark.slow
def test_tp2_x_sp2_on_4_ranks():
    """TP 2 x SP 2 (4 ranks): each tp rank's 2 heads split once more over sp."""
    cases = [("gpt", 16, True, config(2, 1, tp=2)), ("hf_llama", 16, False, config(2, 3, tp=2))]
    out = run_ranks(_ranks, 4, cases, timeout=170)
    for i, (kind, seq, pad, _) in enumerate(cases):
        ref = reference(kind, seq, pad)
        for r in range(4):
            check(out[r][i], ref, f"{kind} tp2 sp2 rank {r}")
    assert out[0][0]["sizes"] == {**out[0][0]["sizes"], "tp": 2, "sp": 2, "dp": 2}


def _resume(rank: int, world: int, save_dir: str) -> dict:
    """Step 0 at SP 2 (each rank passing its own chunk with global position_ids and shifted
    labels, as DeepSpeed's UlyssesSPDataLoaderAdapter yields them), saved; step 1 at SP 1
    (plain data parallelism, one sequence per rank), saved; step 2 at SP 2 again."""
    import zeal

    ids, labels = batches(16, False, 3)
    losses = []
    eng = zeal.initialize(build("llama", 16), config(2, 1))
    shift = torch.nn.functional.pad(labels[0][:, 1:], (0, 1), value=-100)
    cut = slice(8 * rank, 8 * rank + 8)
    pos = torch.arange(16)[cut].expand(MICRO, 8)
    loss = eng(input_ids=ids[0][:, cut], position_ids=pos, shift_labels=shift[:, cut])
    eng.backward(loss)
    eng.step()
    losses.append(loss.item())
    eng.save_checkpoint(save_dir, tag="sp2")
    eng.close()
    eng = zeal.initialize(build("llama", 16), {**config(1, 1), "train_micro_batch_size_per_gpu": 1})
    eng.load_checkpoint(save_dir, tag="sp2")
    loss = eng(input_ids=ids[1][rank:rank + 1], labels=labels[1][rank:rank + 1])
    eng.backward(loss)
    eng.step()
    losses.append(eng.mesh.dp.all_reduce_scalar(loss.item()) / 2)  # equal token counts: the batch mean
    eng.save_checkpoint(save_dir, tag="sp1")
    eng.close()
    eng = zeal.initialize(build("llama", 16), config(2, 3))
    eng.load_checkpoint(save_dir, tag="sp1")
    loss = eng(input_ids=ids[2], labels=labels[2])
    eng.backward(loss)
    eng.step()
    losses.append(loss.item())
    state = eng.module_state_dict()
    eng.close()
    return {"losses": losses, "state": state}


def test_checkpoint_is_layout_free_sp2_to_sp1_and_back(tmp_path):
    """An SP 2 checkpoint resumes at SP 1 and that one at SP 2 (ZeRO 1 and 3): the three
    steps equal one process's, losses and final parameters."""
    final: dict = {}
    ref_losses, _ = reference("llama", 16, False, 3, final)
    out = run_ranks(_resume, 2, str(tmp_path), timeout=150)
    for r in range(2):
        assert out[r]["losses"] == pytest.approx(ref_losses, rel=1e-5)
        for name, want in final.items():
            assert torch.allclose(torch.as_tensor(out[r]["state"][name]), want, rtol=1e-5, atol=1e-6), name


def test_zeal_train_sp_flag_reaches_the_config_and_is_checked(capsys):
    from zeal.cli.main import build_parser, main
    from zeal.cli.train import build_spec

    parser, _ = build_parser("train")
    args, extra = parser.parse_known_args(["train", "--nproc", "4", "--sp", "2", "--seq-len", "64"])
    spec = build_spec(args, extra)
    assert spec.engine["sequence_parallel_size"] == 2 and spec.data.seq_len == 64
    assert main(["train", "--nproc", "2", "--sp", "3"]) == 2
    assert "--sp 3 does not divide the 2 processes" in capsys.readouterr().err


@pytest.mark.slow
def test_sp2_hf_qwen2_and_mistral():
    cases = [("qwen2", 16, True, config(2, 3)), ("mistral", 16, False, config(2, 1))]
    out = run_ranks(_ranks, 2, cases, timeout=170)
    for i, (kind, seq, pad, _) in enumerate(cases):
        ref = reference(kind, seq, pad)
        for r in range(2):
            check(out[r][i], ref, f"{kind} sp2 rank {r}")
