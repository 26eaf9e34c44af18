"""``tflops`` and ``mfu`` of an RLHF step (GRPO, PPO, DPO), with generation and training counted apart.

The count is :mod:`zeal.utils.flops`'s (``zeal train``'s): 2 FLOPs per weight of a linear
layer per token forward, 4 backward, and attention's two matmuls at ``4·L·d·s`` per token
forward (``8·L·d·s`` backward) over ``s`` tokens of context. What is counted is the work the
step does, not the padded rows:

- generation: each group's prompt once (prefill) and every answer token, forward only
  (in a multi-turn episode the observation tokens too);
- training: the policy's forward and backward, and the reference's forward when ``beta``
  > 0, over the distinct prompts once per group when prompts are shared
  (``rlhf.share_prompt``), else over every row, and the LM head on answer tokens only
  (zeal projects only those).

- PPO: generation as GRPO's (one answer per prompt); training: the actor's forward and
  backward per PPO epoch (3 forwards each), the reference's forward, the critic's forward
  for the old values and its forward and backward per epoch, the reward model's forward
  (when the reward is a model), and the PPO-ptx rows' forward and backward per epoch; the
  actor's and reference's LM head on answer tokens, the critic's and reward model's value
  head on every token;
- DPO: the policy's forward and backward over each pair's chosen and rejected rows (the LM
  head on every position: DPO projects them all); the reference's log-probs are computed
  once before training, not in a step.

``tflops`` = all of it over the step's wall seconds (waiting for a batch included); ``mfu`` =
that over the device's peak (:func:`zeal.utils.flops.peak_flops`: a datasheet's dense bf16
peak on a known GPU, a measured fp32 matmul rate on a CPU); ``tflops_generate`` /
``tflops_train`` are each side's FLOPs over its own seconds.
"""

from __future__ import annotations

from torch import nn

from zeal.utils.flops import attention_shape, matmul_weights, peak_flops


def _head_weights(model: nn.Module) -> int:
    head = getattr(model, "lm_head", None)
    return head.weight.numel() if isinstance(head, nn.Linear) else 0


class StepFlops:
    """Per-step FLOP figures of a policy ``model`` (counted before ZeRO partitions it);
    :meth:`bind` names the device whose peak ``mfu`` divides by."""

    def __init__(self, model: nn.Module) -> None:
        self.head = _head_weights(model)
        self.trunk = matmul_weights(model) - self.head
        # a value model (the critic, a reward model) holds its LM as ``lm``: the config is there
        self.layers, self.width = attention_shape(next((m for m in model.modules() if hasattr(m, "config")), model))
        self.peak, self.peak_source = float("nan"), ""

    def bind(self, device) -> StepFlops:
        self.peak, self.peak_source = peak_flops(device.type, device.index or 0)
        return self

    def forward(self, tokens: int, context: int, head_tokens: int) -> float:
        """Forward FLOPs of ``tokens`` through the trunk at ``context`` tokens of context,
        ``head_tokens`` of them through the LM head."""
        return 2.0 * (self.trunk * tokens + self.head * head_tokens) + 4.0 * self.layers * self.width * context * tokens

    def grpo(self, rollouts, shared_prompts: bool, reference: bool, generate_s: float, train_s: float,
             wall_s: float) -> dict[str, float]:
        """The step's figures for its ``rollouts`` (``prompt_ids``, ``output_ids``, ``group``);
        ``wall_s``: the step's wall time (with async rollouts less than generation + training)."""
        prompts = {r.group: len(r.prompt_ids) for r in rollouts}
        answers = sum(self.forward(len(r.output_ids), len(r.prompt_ids) + len(r.output_ids), len(r.output_ids))
                      for r in rollouts)
        gen = self.generation(rollouts)
        fwd = 0.0
        if shared_prompts:
            fwd += sum(self.forward(n, n, 0) for n in prompts.values()) + answers
        else:
            fwd += sum(self.forward(len(r.prompt_ids) + len(r.output_ids), len(r.prompt_ids) + len(r.output_ids),
                                    len(r.output_ids)) for r in rollouts)
        train = fwd * 3.0 + (fwd if reference else 0.0)  # forward + backward (2x forward), the reference's forward
        return self._figures(gen, train, generate_s, train_s, wall_s)

    def rows(self, lengths: list[int], head: list[int]) -> float:
        """Forward FLOPs of whole rows of ``lengths`` tokens, ``head[i]`` of row i through the LM head."""
        return sum(self.forward(n, n, h) for n, h in zip(lengths, head))

    def generation(self, rollouts) -> float:
        """Generation FLOPs of ``rollouts``: each group's prompt once (the prefill samples the
        first token), then every answer token at its context."""
        prompts = {r.group: len(r.prompt_ids) for r in rollouts}
        return sum(self.forward(n, n, 1) for n in prompts.values()) + sum(
            self.forward(len(r.output_ids), len(r.prompt_ids) + len(r.output_ids), len(r.output_ids))
            for r in rollouts)

    def ppo(self, rollouts, critic: StepFlops, reward: StepFlops | None, epochs: int, ptx: list[int],
            generate_s: float, train_s: float, wall_s: float) -> dict[str, float]:
        """A PPO iteration's figures (see the module docstring): ``critic`` / ``reward`` count the
        value models (``reward`` None: a Python reward), ``ptx`` the lengths of the PPO-ptx rows."""
        lengths = [len(r.prompt_ids) + len(r.output_ids) for r in rollouts]
        actor = self.rows(lengths, [len(r.output_ids) for r in rollouts])
        values = critic.rows(lengths, [0] * len(lengths))
        train = actor * (3 * epochs + 1) + values * (3 * epochs + 1) + 3 * epochs * self.rows(ptx, ptx)
        if reward is not None:
            train += reward.rows(lengths, [0] * len(lengths))
        return self._figures(self.generation(rollouts), train, generate_s, train_s, wall_s)

    def dpo(self, lengths: list[int], wall_s: float) -> dict[str, float]:
        """A DPO step's ``tflops`` / ``mfu``: forward and backward over the chosen and rejected
        rows of ``lengths`` tokens (every position through the LM head)."""
        total = 3.0 * self.rows(lengths, lengths)
        return {"tflops": total / max(wall_s, 1e-9) / 1e12, "mfu": total / max(wall_s, 1e-9) / self.peak}

    def _figures(self, gen: float, train: float, generate_s: float, train_s: float,
                 wall_s: float) -> dict[str, float]:
        total = gen + train
        return {"tflops": total / max(wall_s, 1e-9) / 1e12, "mfu": total / max(wall_s, 1e-9) / self.peak,
                "tflops_generate": gen / max(generate_s, 1e-9) / 1e12,
                "tflops_train": train / max(train_s, 1e-9) / 1e12}
