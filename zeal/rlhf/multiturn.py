"""Multi-turn episodes: the policy acts, an environment answers, until it says done.

An :class:`Environment` speaks token ids: ``reset()`` returns the first observation (the
prompt's ids), ``step(action)`` takes the policy's turn (its ids and text) and returns
``(observation ids, reward, done)``; the observation's tokens are appended to the episode
and carry loss mask 0 (the policy did not choose them), the policy's tokens mask 1.
:func:`run_episodes` plays a batch of environments turn by turn, every live episode's turn
generated in one call of the serving engine, and returns one :class:`Rollout` per
episode (``output_ids`` all turns and observations, ``loss_mask``, the generator's
log-probs, the summed reward in ``reward``).

:class:`ToolEnv` is the chat one: the prompt goes through the model's chat template with
the tools' specs; a turn that is a tool call (zeal's parser,
:func:`zeal.inference.tools.parse_tool_calls`: a JSON call, bare or between
``<tool_call>`` tags) runs the tools and answers with their outputs as ``tool`` messages,
rendered by the template; any other turn is the final answer, scored by the reward
functions (``fn(prompts, completions, **kw)``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from zeal.inference.sampling_params import SamplingParams
from zeal.inference.tools import parse_tool_calls
from zeal.rlhf.hybrid import Rollout


@dataclass
class Action:
    """One policy turn: its token ids, their text, and why generation stopped."""

    ids: list[int]
    text: str
    finish_reason: str | None = None


class Environment(Protocol):
    """``reset() -> prompt ids``; ``step(action) -> (observation ids, reward, done)``."""

    def reset(self) -> list[int]: ...

    def step(self, action: Action) -> tuple[list[int], float, bool]: ...


@dataclass
class Episode:
    """A finished or live episode: the prompt, the appended tokens with their mask and the
    generator's log-probs (0 on observations), the reward so far, the turns taken."""

    prompt_ids: list[int]
    output_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    reward: float = 0.0
    turns: int = 0
    done: bool = False
    text: str = ""
    finish_reason: str | None = None


def run_episodes(hybrid, envs: Sequence[Environment], params: SamplingParams, max_turns: int,
                 max_tokens: int | None = None, sync: bool = True) -> tuple[list[Rollout], list[float]]:
    """Play every environment until done, ``max_turns`` policy turns, or ``max_tokens``
    appended tokens (the episode then ends as cut by length: ``finish_reason`` "length"). ``params.n`` must be 1 (one
    episode per environment); its ``seed`` is offset per turn. Returns the rollouts (in
    ``envs`` order, ``group`` = index) and each episode's summed reward."""
    if params.n != 1:
        raise ValueError("run_episodes plays one episode per environment: SamplingParams.n must be 1")
    eps = [Episode(list(env.reset()), [], [], []) for env in envs]
    for turn in range(max_turns):
        live = [i for i, e in enumerate(eps) if not e.done]
        if not live:
            break
        seed = None if params.seed is None else params.seed + 1_000_003 * turn
        p = SamplingParams(**{**params.__dict__, "seed": seed, "logprobs": 0})
        outs = hybrid.generate([eps[i].prompt_ids + eps[i].output_ids for i in live], p, sync=sync and turn == 0)
        for i, ro in zip(live, outs):
            e = eps[i]
            e.output_ids += ro.output_ids
            e.loss_mask += [1] * len(ro.output_ids)
            e.logprobs += list(ro.logprobs[: len(ro.output_ids)])
            e.turns += 1
            e.text, e.finish_reason = ro.text, ro.finish_reason
            obs, reward, done = envs[i].step(Action(list(ro.output_ids), ro.text, ro.finish_reason))
            e.reward += float(reward)
            over = max_tokens is not None and len(e.output_ids) + len(obs) >= max_tokens
            if done or over or turn == max_turns - 1:
                e.done = True
                if over or not done:  # cut short of the environment's end
                    e.finish_reason = "length"
                continue
            e.output_ids += obs
            e.loss_mask += [0] * len(obs)
            e.logprobs += [0.0] * len(obs)
    rollouts = [Rollout(e.prompt_ids, e.output_ids, e.logprobs, e.text, e.finish_reason, g, e.loss_mask)
                for g, e in enumerate(eps)]
    return rollouts, [e.reward for e in eps]


class ToolEnv:
    """A chat episode with tools (see the module docstring). ``tokenizer``: zeal's, with a
    chat template that renders ``tools`` and ``tool`` messages; ``tools``: functions by
    name (called with the call's JSON arguments as keywords); ``specs``: their OpenAI specs;
    ``reward_fns``: scored on the final answer; ``row``: the prompt (text, messages, or a
    dict with ``prompt`` and fields such as ``answer`` that reward functions read).
    A tool that raises answers ``error: ...``; an unknown tool is not a call.
    ``tool_reward``: added once, with the final answer, to an episode in which a tool ran
    without error (a shaping term for teaching a model to use the tools at all; 0: off). An
    episode cut by ``max_turns`` while still calling earns none: paid per call, a policy
    learned to call the tool on every turn and never answer (``bench/rlhf/bench_tools.py``)."""

    def __init__(self, tokenizer, row: Any, tools: dict[str, Callable[..., str]], specs: list[dict],
                 reward_fns: Sequence[Callable] = (), system: str | None = None, tool_reward: float = 0.0) -> None:
        self.tok, self.row, self.tools, self.specs = tokenizer, row, tools, specs
        self.funcs = [s["function"] for s in specs]
        self.reward_fns = list(reward_fns)
        prompt = row.get("prompt") if isinstance(row, dict) else row
        msgs = list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]
        self.messages = ([{"role": "system", "content": system}] if system else []) + msgs
        self.calls = 0
        self.tool_reward, self.tool_ok = tool_reward, False

    def reset(self) -> list[int]:
        return self.tok.encode(self.tok.render_chat(self.messages, tools=self.specs), add_special_tokens=False)

    def step(self, action: Action) -> tuple[list[int], float, bool]:
        calls = parse_tool_calls(action.text, self.funcs)  # a turn cut by length is a call only if it parses
        if calls is None:
            reward = sum(float(fn([self.row], [action.text])[0]) for fn in self.reward_fns)
            if self.tool_reward and self.tool_ok:  # paid with the final answer: calling on and on earns nothing
                reward += self.tool_reward
            return [], reward, True
        self.calls += len(calls)
        before = self.tok.render_chat(self.messages, tools=self.specs)
        asst = {"role": "assistant", "content": action.text, "tool_calls": calls}
        results = [{"role": "tool", "tool_call_id": c["id"], "name": c["function"]["name"],
                    "content": self._run(c["function"])} for c in calls]
        turn = self.tok.render_chat(self.messages + [asst], add_generation_prompt=False, tools=self.specs)
        closing = self._closing()
        self.messages += [asst] + results
        full = self.tok.render_chat(self.messages, tools=self.specs)
        self.tool_ok = self.tool_ok or not any(m["content"].startswith("error:") for m in results)
        return self._observation(before, turn, full, closing, action), 0.0, False

    def _run(self, function: dict) -> str:
        try:
            args = json.loads(function["arguments"])
            return str(self.tools[function["name"]](**args))
        except Exception as e:  # a tool's failure is an observation, not a crash of the run
            return f"error: {e}"

    _SENTINEL = "\u2063zeal-turn-end\u2063"

    def _closing(self) -> str:
        """What the template writes after an assistant turn's text to close it (ChatML:
        ``<|im_end|>\n``), found by rendering a turn of sentinel text."""
        done = self.tok.render_chat(self.messages + [{"role": "assistant", "content": self._SENTINEL}],
                                    add_generation_prompt=False, tools=self.specs)
        at = done.rfind(self._SENTINEL)
        return done[at + len(self._SENTINEL):] if at >= 0 else ""

    def _observation(self, before: str, turn: str, full: str, closing: str, action: Action) -> list[int]:
        """The ids after the policy's tokens: the template's close of an assistant turn (less
        an end-of-turn token the policy produced itself), then the tool messages and the
        next generation prompt. The policy's own text stands for its turn: a template that
        renders ``tool_calls`` apart from the content (Qwen / Hermes style) would otherwise
        write the call a second time into the context. TRL likewise appends only the tool
        messages' rendering to the policy's tokens."""
        if not (turn.startswith(before) and full.startswith(turn)):
            raise ValueError("the chat template does not render a conversation as a prefix of its continuation; "
                             "multi-turn episodes need one that does")
        tail_ids = self.tok.encode(closing, add_special_tokens=False) if closing else []
        if tail_ids and action.ids and tail_ids[0] == action.ids[-1]:
            tail_ids = tail_ids[1:]  # the end-of-turn token the policy generated
        return tail_ids + self.tok.encode(full[len(turn):], add_special_tokens=False)


def tool_environment(tokenizer, rc) -> Callable[[Any], ToolEnv]:
    """The environment factory of the config's tools (``rc.tools``, ``rc.retrieval_file``,
    ``rc.tool_reward``): a fresh :class:`ToolEnv` per answer; the episode's final answer is
    scored by GRPO's reward functions (``fn(rows, final texts)``)."""
    from zeal.rlhf.tools import select_tools

    fns, specs = select_tools(list(rc.tools), rc.retrieval_file)

    def make(row: Any) -> ToolEnv:
        return ToolEnv(tokenizer, row, fns, specs, tool_reward=rc.tool_reward)

    return make
