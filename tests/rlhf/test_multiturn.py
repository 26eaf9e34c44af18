"""Multi-turn episodes with tools (zeal.rlhf.multiturn, tools, verifiers): the calculator
evaluates arithmetic and refuses anything else; retrieval ranks passages; the verifiers
check math answers and run code tests in a sandboxed subprocess; an episode's tool outputs
carry loss mask 0 and its policy tokens 1, the tokens being the chat template's rendering
of the whole conversation; GRPO on a calculator-tool arithmetic task raises the reward."""

import pytest
import torch

from zeal.rlhf import tools, verifiers
from zeal.rlhf.multiturn import Action, ToolEnv, run_episodes
from zeal.rlhf.tasks import CALC_EXPRESSIONS, calculator_call, calculator_task

pytestmark = pytest.mark.timeout(120)

EXPRS = list(CALC_EXPRESSIONS)
call = calculator_call  # one whitespace-free word: the test tokenizer makes a whole call one token


def make_tokenizer():
    tok, _, vocab = calculator_task()
    return tok, vocab


def test_calculator_is_safe():
    assert tools.calculator("2 + 3 * (4 - 1)") == "11" and tools.calculator("7 / 2") == "3.5"
    assert tools.calculator("2 ** 10") == "1024" and tools.calculator("-3 // 2") == "-2"
    for bad in ("__import__('os').system('true')", "open('x')", "x + 1", "(1).real", "'a' * 3", "2 ** 1000",
                "10 ** 20 * 10 ** 20", "1 / 0", "lambda: 1", "[1, 2]", "1 if 1 else 2", "9" * 300):
        assert tools.calculator(bad).startswith("error:"), bad
    with pytest.raises(ValueError, match="not allowed"):
        tools.safe_eval("abs(-1)")


def test_retriever_ranks_by_word_overlap(tmp_path):
    f = tmp_path / "doc.txt"
    f.write_text("Paris is the capital of France.\n\nThe Nile is a river in Africa.\n\nBerlin is in Germany.\n")
    r = tools.Retriever(f)
    assert r("Which river flows in Africa?") == "The Nile is a river in Africa."
    assert r.search("capital France Germany", k=2)[0].startswith("Paris")
    fns, specs = tools.builtin_tools(f)
    assert set(fns) == {"calculator", "search"} and [s["function"]["name"] for s in specs] == ["calculator", "search"]


def test_math_answer_verifier():
    rows = [{"answer": 5}, {"answer": "0.5"}, {"answer": 12}, {"answer": 3}]
    outs = ["so it is 5", "the result is \\boxed{1/2} (not 3)", "1,000 and then 12.0", "no idea"]
    assert verifiers.math_answer_reward(rows, outs) == [1.0, 1.0, 1.0, 0.0]
    assert verifiers.math_answer_reward(["q"], ["7"], answer=[7]) == [1.0]


def test_code_tests_verifier_runs_sandboxed():
    tests = "assert add(2, 3) == 5"
    good = "```python\ndef add(a, b):\n    return a + b\n```"
    rows = [{"tests": tests}] * 4
    outs = [good, "def add(a, b):\n    return a - b", "def add(a, b):\n    while True: pass",
            "import socket\nsocket.create_connection(('example.com', 80))\ndef add(a, b):\n    return a + b"]
    assert verifiers.run_tests("def add(a, b):\n    while True: pass", tests, timeout=1.0) is False
    assert verifiers.code_tests_reward(rows[:2] + rows[3:], outs[:2] + outs[3:]) == [1.0, 0.0, 0.0]


def test_load_callable():
    assert verifiers.load_callable("zeal.rlhf.verifiers:math_answer_reward") is verifiers.math_answer_reward
    with pytest.raises(ValueError, match="module:function"):
        verifiers.load_callable("nocolon")
    with pytest.raises(ValueError, match="no_such"):
        verifiers.load_callable("zeal.rlhf.verifiers:no_such")


class ScriptedHybrid:
    """Each call answers turn t of every prompt with script[t] (its ids, then <eos>)."""

    def __init__(self, tok, script):
        self.tok, self.script, self.turn = tok, script, 0

    def generate(self, prompts, params, sync=True):
        from zeal.rlhf.hybrid import Rollout

        text = self.script[self.turn]
        self.turn += 1
        ids = self.tok.encode(text, add_special_tokens=False) + [1]
        return [Rollout(p, ids, [-0.5] * len(ids), text, "stop", g) for g, p in enumerate(prompts)]


def test_tool_outputs_carry_mask_zero_and_tokens_follow_the_template():
    from zeal.inference.sampling_params import SamplingParams

    tok, _ = make_tokenizer()
    fns, specs = tools.builtin_tools()
    env = ToolEnv(tok, {"prompt": "What is 4*2 ?", "answer": 8}, fns, specs, [verifiers.math_answer_reward])
    hybrid = ScriptedHybrid(tok, [call("4*2"), "8"])
    (ro,), (reward,) = run_episodes(hybrid, [env], SamplingParams(max_tokens=4), max_turns=3)
    assert reward == 1.0 and env.calls == 1 and ro.finish_reason == "stop"
    # the episode's tokens are the template's rendering of the conversation
    want = tok.encode(tok.render_chat(env.messages + [{"role": "assistant", "content": "8"}],
                                      add_generation_prompt=False), add_special_tokens=False)
    assert ro.prompt_ids + ro.output_ids == want
    words = [tok.decode([t], skip_special_tokens=False) for t in ro.output_ids]
    assert words == [call("4*2"), "<eos>", "tool", ":", "8", "<eos>", "assistant", ":", "8", "<eos>"]
    assert ro.loss_mask == [1, 1, 0, 0, 0, 0, 0, 0, 1, 1]
    assert ro.logprobs == [-0.5, -0.5, 0, 0, 0, 0, 0, 0, -0.5, -0.5]
    # a wrong final answer scores 0; a non-call ends the episode at once
    env2 = ToolEnv(tok, {"prompt": "What is 4*2 ?", "answer": 8}, fns, specs, [verifiers.math_answer_reward])
    (ro2,), (r2,) = run_episodes(ScriptedHybrid(tok, ["7"]), [env2], SamplingParams(max_tokens=4), max_turns=3)
    assert r2 == 0.0 and ro2.loss_mask == [1, 1]
    # the episode ends at max_turns even mid-tool-use
    env3 = ToolEnv(tok, {"prompt": "What is 4*2 ?", "answer": 8}, fns, specs)
    (ro3,), _ = run_episodes(ScriptedHybrid(tok, [call("4*2")]), [env3], SamplingParams(max_tokens=4), max_turns=1)
    assert ro3.loss_mask == [1, 1] and ro3.finish_reason == "length"
    # the environment interface is the plain one
    assert env3.step(Action([5], "8", "stop"))[2] is True


# a template that, like Qwen's / Hermes', writes an assistant turn's tool_calls after its content
SEPARATE_CALLS = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }}{% for c in m.get('tool_calls') or [] %}"
                  " {{ c['function']['name'] }}{% endfor %} <eos> {% endfor %}"
                  "{% if add_generation_prompt %}assistant : {% endif %}")


def test_a_template_rendering_tool_calls_apart_does_not_repeat_the_call():
    """The policy's own tokens stand for its tool-calling turn: the observation is the
    template's close of a turn, then the tool messages and the next prompt, never the call
    rendered a second time from ``tool_calls`` (the old observation was the rest of the
    re-rendered turn: ``calculator <eos> tool : 8 ...``)."""
    from zeal.inference.sampling_params import SamplingParams
    from zeal.inference.tokenizer import Tokenizer

    base, _ = make_tokenizer()
    tok = Tokenizer(base.tok, {"eos_token": "<eos>", "chat_template": SEPARATE_CALLS})
    fns, specs = tools.builtin_tools()
    env = ToolEnv(tok, {"prompt": "What is 4*2 ?", "answer": 8}, fns, specs, [verifiers.math_answer_reward])
    (ro,), (reward,) = run_episodes(ScriptedHybrid(tok, [call("4*2"), "8"]), [env], SamplingParams(max_tokens=4),
                                    max_turns=3)
    assert reward == 1.0 and env.calls == 1
    words = [tok.decode([t], skip_special_tokens=False) for t in ro.output_ids]
    assert words == [call("4*2"), "<eos>", "tool", ":", "8", "<eos>", "assistant", ":", "8", "<eos>"]
    assert ro.loss_mask == [1, 1, 0, 0, 0, 0, 0, 0, 1, 1]


def test_tool_reward_is_paid_with_the_final_answer_only():
    """The shaping bonus comes with a final answer after a successful call; an episode cut
    while still calling earns none (paid per call, a policy learned to call on every turn)."""
    from zeal.inference.sampling_params import SamplingParams

    tok, _ = make_tokenizer()
    fns, specs = tools.builtin_tools()
    row = {"prompt": "What is 4*2 ?", "answer": 8}

    def play(script, max_turns):
        env = ToolEnv(tok, row, fns, specs, [verifiers.math_answer_reward], tool_reward=0.5)
        return run_episodes(ScriptedHybrid(tok, script), [env], SamplingParams(max_tokens=4), max_turns)[1][0]

    assert play([call("4*2"), "8"], 3) == 1.5 and play([call("4*2"), "7"], 3) == 0.5
    assert play([call("4*2"), call("4*2")], 2) == 0.0 and play(["8"], 3) == 1.0


def _arith_rows():
    return [{"prompt": f"What is {e} ?", "answer": tools.safe_eval(e)} for e in EXPRS]


def test_grpo_calculator_task_reward_rises(tmp_path):
    from zeal.models.llama import Llama, LlamaConfig
    from zeal.rlhf import grpo

    tok, vocab = make_tokenizer()
    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                              eos_token_id=1))
    fns, specs = tools.builtin_tools()

    def env(row):
        return ToolEnv(tok, row, fns, specs, [verifiers.math_answer_reward], tool_reward=0.5)

    cfg = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "rlhf": {"steps": 24, "batch_size": 4, "num_generations": 4, "max_new_tokens": 1, "max_turns": 2,
                    "beta": 0.0, "generation_dtype": "fp32", "loss_type": "dapo", "seed": 1}}
    res = grpo(model, None, _arith_rows(), cfg, tokenizer=tok, eos_token_ids=[1], environment=env,
               out=str(tmp_path))
    rewards = [r["reward"] for r in res.metrics]
    first, last = sum(rewards[:4]) / 4, sum(rewards[-4:]) / 4
    assert last > first + 0.2, rewards
