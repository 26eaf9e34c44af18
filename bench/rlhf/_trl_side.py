"""TRL's side of ``bench_trl.py``; runs in TRL's own virtual environment (never zeal's):

    /work/peers/trl/bin/python bench/rlhf/_trl_side.py SPEC.json OUT.json

``SPEC.json`` (written by ``bench_trl.py``): ``{"job": "dpo" | "rm" | "grpo" | "ppo", "model": folder, ...}``.
DPO: the rows in the order zeal visits them (a sequential sampler, no shuffling), one
record per optimizer step (the exact loss tensor, not the rounded logged value). RM: the
same, then the held-out accuracy. GRPO:
the prompts in zeal's order, time per step split into generation (``model.generate``
with the training weights) and the rest, the mean reward of every step (the reward
function of ``zeal/rlhf/tasks.py`` named by ``spec["reward"]``).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time

import torch


def _common_args(spec: dict, out_dir: str) -> dict:
    return {"output_dir": out_dir, "max_steps": spec["steps"], "learning_rate": spec["lr"],
            "lr_scheduler_type": "constant", "warmup_steps": 0, "weight_decay": 0.0, "max_grad_norm": spec["grad_clip"],
            "optim": "sgd" if spec["optimizer"] == "SGD" else "adamw_torch", "logging_steps": 1,
            "save_strategy": "no", "report_to": [], "seed": spec["seed"], "use_cpu": True, "bf16": False,
            "fp16": False, "disable_tqdm": True, "dataloader_num_workers": 0}


def _sequential(cls):
    """``cls`` with the training rows taken in dataset order (zeal's order is in the spec)."""
    from torch.utils.data import SequentialSampler

    class Sequential(cls):
        def _get_train_sampler(self, *args, **kwargs):
            return SequentialSampler(self.train_dataset)

    return Sequential


def _repeat_sampler(n: int, g: int):
    """Each of the ``n`` training rows ``g`` times in a row, in dataset order (a GRPO batch's
    groups as zeal forms them)."""
    from torch.utils.data import Sampler

    class Repeat(Sampler):
        def __iter__(self):
            return iter([i for i in range(n) for _ in range(g)])

        def __len__(self):
            return n * g

    return Repeat()


def run_dpo(spec: dict) -> dict:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    torch.manual_seed(spec["seed"])
    tok = AutoTokenizer.from_pretrained(spec["model"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    rows = [{"prompt": [{"role": "user", "content": r["prompt"]}],
             "chosen": [{"role": "assistant", "content": r["chosen"]}],
             "rejected": [{"role": "assistant", "content": r["rejected"]}]} for r in spec["rows"]]
    steps: list[dict] = []

    class Recording(_sequential(DPOTrainer)):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            m = self._metrics["train"]
            steps.append({"loss": float(loss.detach()), "logps_chosen": m["logps/chosen"][-1],
                          "logps_rejected": m["logps/rejected"][-1], "margin": m["rewards/margins"][-1],
                          "n_tokens": int(inputs["completion_mask"].sum()),
                          "input_ids": inputs["input_ids"].tolist(),
                          "completion_mask": inputs["completion_mask"].tolist()})
            return loss

    with tempfile.TemporaryDirectory() as d:
        args = DPOConfig(**_common_args(spec, d), per_device_train_batch_size=spec["batch_size"],
                         beta=spec["beta"], loss_type=["sigmoid"], max_length=spec["max_length"])
        trainer = Recording(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tok)
        t0 = time.perf_counter()
        trainer.train()
        wall = time.perf_counter() - t0
    return {"steps": steps, "train_s": wall}


def run_rm(spec: dict) -> dict:
    """``RewardTrainer`` (SmolLM with a 1-output ``score`` head, last-token pairwise loss) on
    the training pairs in zeal's order; the loss of every step, then the accuracy on the
    held-out pairs (``trainer.evaluate``)."""
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from trl import RewardConfig, RewardTrainer

    torch.manual_seed(spec["seed"])
    tok = AutoTokenizer.from_pretrained(spec["model"])
    model = AutoModelForSequenceClassification.from_pretrained(spec["model"], num_labels=1, dtype=torch.float32)
    tok.pad_token = tok.pad_token or tok.eos_token
    model.config.pad_token_id = tok.pad_token_id

    def rows(rs):
        return Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}],
                                   "chosen": [{"role": "assistant", "content": r["chosen"]}],
                                   "rejected": [{"role": "assistant", "content": r["rejected"]}]} for r in rs])

    steps: list[float] = []

    class Recording(_sequential(RewardTrainer)):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            out = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            if self.model.training:
                steps.append(float((out[0] if return_outputs else out).detach()))
            return out

    with tempfile.TemporaryDirectory() as d:
        args = RewardConfig(**_common_args(spec, d), per_device_train_batch_size=spec["batch_size"],
                            per_device_eval_batch_size=len(spec["held"]), max_length=1024)
        trainer = Recording(model=model, args=args, train_dataset=rows(spec["rows"]), eval_dataset=rows(spec["held"]),
                            processing_class=tok)
        t0 = time.perf_counter()
        trainer.train()
        wall = time.perf_counter() - t0
        ev = trainer.evaluate()
    return {"loss": steps, "accuracy": ev.get("eval_accuracy"), "train_s": wall}


def _task_reward(spec: dict):
    """The task's reward function of ``zeal.rlhf.tasks`` named by ``spec["reward"]`` (pure
    Python on texts; only that module is imported from zeal's checkout)."""
    import importlib.util

    path = f"{spec['zeal_root']}/zeal/rlhf/tasks.py"
    mod_spec = importlib.util.spec_from_file_location("zeal_tasks", path)
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    return getattr(mod, spec.get("reward", "arithmetic_reward"))


def _python_reward_model(ppo_mod, reward_model, tok, spec: dict) -> None:
    """TRL 0.29's PPO scores with a reward model only: route its reward-model calls of
    ``get_reward`` to the task's Python reward on the decoded question and answer (the
    value model's calls go through unchanged)."""
    reward = _task_reward(spec)
    original = ppo_mod.get_reward

    def get_reward(model, query_responses, pad_token_id, context_length):
        if model is not reward_model:
            return original(model, query_responses, pad_token_id, context_length)
        questions = tok.batch_decode(query_responses[:, :context_length], skip_special_tokens=True)
        answers = [tok.decode([t for t in row.tolist() if t != pad_token_id], skip_special_tokens=True)
                   for row in query_responses[:, context_length:]]
        scores = torch.tensor(reward(questions, answers), dtype=torch.float32)
        return None, scores, None

    ppo_mod.get_reward = get_reward


def run_grpo(spec: dict) -> dict:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    reward = _task_reward(spec)

    torch.manual_seed(spec["seed"])
    tok = AutoTokenizer.from_pretrained(spec["model"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    G = spec["num_generations"]
    # every prompt repeated G times in a row: TRL's sampler groups them, the sequential one keeps zeal's order
    rows = [{"prompt": [{"role": "user", "content": p}], "question": p} for p in spec["prompts"]]
    rewards: list[float] = []
    times = {"generate": [], "step": []}
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            times["step"].append(time.perf_counter() - self.t0)

    def reward_fn(prompts, completions, question, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        out = reward(list(question), texts)
        rewards.append(sum(out) / len(out))
        return out

    class Timed(GRPOTrainer):
        def _get_train_sampler(self, *args, **kwargs):
            return _repeat_sampler(len(self.train_dataset), G)

        def _generate(self, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return super()._generate(*args, **kwargs)
            finally:
                times["generate"].append(time.perf_counter() - t0)

    with tempfile.TemporaryDirectory() as d:
        args = GRPOConfig(**_common_args(spec, d), per_device_train_batch_size=spec["batch_size"] * G,
                          num_generations=G, max_completion_length=spec["max_new_tokens"],
                          temperature=spec["temperature"], top_p=1.0, top_k=0, beta=spec["beta"],
                          epsilon=spec["clip"], loss_type="grpo", scale_rewards="group", num_iterations=1,
                          shuffle_dataset=False, log_completions=False)
        trainer = Timed(model=model, reward_funcs=reward_fn, args=args, train_dataset=Dataset.from_list(rows),
                        processing_class=tok, callbacks=[StepClock()])
        t0 = time.perf_counter()
        trainer.train()
        wall = time.perf_counter() - t0
    return {"rewards": rewards, "generate_s": times["generate"], "step_s": times["step"], "train_s": wall}


def _zeal_module(spec: dict, name: str):
    """A pure-Python module of zeal's checkout (``zeal/rlhf/<name>.py``), loaded by path."""
    import importlib.util

    mod_spec = importlib.util.spec_from_file_location(f"zeal_{name}", f"{spec['zeal_root']}/zeal/rlhf/{name}.py")
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    return mod


def run_grpo_tools(spec: dict) -> dict:
    """TRL's multi-turn GRPO (``GRPOTrainer(tools=[calculator])``): the tokenizer's chat
    template replaced by ``spec["chat_template"]`` (one TRL knows the tool-call format of),
    zeal's calculator (``zeal/rlhf/tools.py``, loaded by path) as the tool, the prompts (chat
    messages) in zeal's order, the task reward on the last assistant message. Per step: the
    mean reward, the exact accuracy, the tool calls per episode (TRL's
    ``tools/call_frequency``) and the step's seconds."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    tasks, tools = _zeal_module(spec, "tasks"), _zeal_module(spec, "tools")

    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression (+, -, *, /, //, %, **, parentheses).

        Args:
            expression: the arithmetic expression
        """
        return tools.calculator(expression)

    torch.manual_seed(spec["seed"])
    tok = AutoTokenizer.from_pretrained(spec["model"])
    tok.chat_template = spec["chat_template"]
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    G = spec["num_generations"]
    rows = [{"prompt": r["prompt"], "answer": r["answer"]} for r in spec["rows"]]
    out = {"rewards": [], "accuracy": [], "tool_calls": [], "step_s": [], "completions": []}

    def final_text(c):
        if isinstance(c, str):
            return c
        said = [m.get("content") or "" for m in c if m.get("role") == "assistant"]
        return said[-1] if said else ""

    def reward_fn(prompts, completions, answer, **_):
        texts = [final_text(c) for c in completions]
        keyed = [{"answer": a} for a in answer]
        r = getattr(tasks, spec["reward"])(keyed, texts)
        out["rewards"].append(sum(r) / len(r))
        exact = tasks.arithmetic_reward(keyed, texts)
        out["accuracy"].append(sum(x > 0 for x in exact) / len(exact))
        if len(out["completions"]) < 4:
            out["completions"].append(json.dumps(completions[0], default=str)[:600])
        return r

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            out["step_s"].append(time.perf_counter() - self.t0)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "tools/call_frequency" in logs:
                out["tool_calls"].append(logs["tools/call_frequency"])
            if spec.get("progress"):  # the steps so far, readable should the run be stopped
                with open(spec["progress"], "w") as f:
                    json.dump(out, f)

    class Ordered(GRPOTrainer):
        def _get_train_sampler(self, *args, **kwargs):
            return _repeat_sampler(len(self.train_dataset), G)

    with tempfile.TemporaryDirectory() as d:
        args = GRPOConfig(**_common_args(spec, d), per_device_train_batch_size=spec["batch_size"] * G,
                          num_generations=G, max_completion_length=spec["max_completion_length"],
                          max_tool_calling_iterations=spec["max_turns"] - 1, temperature=1.0, top_p=1.0, top_k=0,
                          beta=spec["beta"], epsilon=0.2, loss_type="grpo", scale_rewards="group", num_iterations=1,
                          shuffle_dataset=False, log_completions=False)
        trainer = Ordered(model=model, reward_funcs=reward_fn, args=args, train_dataset=Dataset.from_list(rows),
                          processing_class=tok, tools=[calculator], callbacks=[Clock()])
        out["first_prompt"] = tok.apply_chat_template(rows[0]["prompt"], tools=[calculator], tokenize=False,
                                                      add_generation_prompt=True)
        t0 = time.perf_counter()
        trainer.train()
        out["train_s"] = time.perf_counter() - t0
    return out


def run_ppo(spec: dict) -> dict:
    """TRL's last PPO (0.29's ``trl.experimental.ppo``, put first on ``PYTHONPATH`` by the
    driver): policy, reference, value model and a reward model (SmolLM with a scalar head:
    this PPO takes no Python reward; with ``spec["reward"]`` its calls are routed to that
Python function instead), one PPO epoch per rollout batch."""
    from datasets import Dataset
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoTokenizer,
        TrainerCallback,
    )
    from trl.experimental.ppo import PPOConfig, PPOTrainer
    from trl.experimental.ppo import ppo_trainer as ppo_mod

    torch.manual_seed(spec["seed"])
    tok = AutoTokenizer.from_pretrained(spec["model"], padding_side="left")
    tok.pad_token = tok.pad_token or tok.eos_token

    def lm():
        return AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)

    def scalar():
        return AutoModelForSequenceClassification.from_pretrained(spec["model"], num_labels=1, dtype=torch.float32)

    policy, ref, reward, value = lm(), lm(), scalar(), scalar()
    for m in (reward, value):
        m.config.pad_token_id = tok.pad_token_id
    rows = [{"input_ids": tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                  tokenize=True, return_dict=True)["input_ids"]}
            for p in spec["prompts"]]
    times = {"generate": [], "step": [], "scores": []}
    generate = ppo_mod.batch_generation

    def timed_generation(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return generate(*args, **kwargs)
        finally:
            times["generate"].append(time.perf_counter() - t0)

    ppo_mod.batch_generation = timed_generation
    if spec.get("reward"):
        _python_reward_model(ppo_mod, reward, tok, spec)

    class Clock(TrainerCallback):
        t0 = None

        def on_step_end(self, args, state, control, **kwargs):
            now = time.perf_counter()
            times["step"].append(now - (self.t0 or start))
            self.t0 = now

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "objective/scores" in logs:
                times["scores"].append(logs["objective/scores"])

    B = spec["batch_size"]
    with tempfile.TemporaryDirectory() as d:
        args = PPOConfig(**_common_args(spec, d), per_device_train_batch_size=B, gradient_accumulation_steps=1,
                         num_mini_batches=1, total_episodes=spec["steps"] * B, num_ppo_epochs=1,
                         response_length=spec["max_new_tokens"], stop_token="eos", temperature=1.0,
                         local_rollout_forward_batch_size=B, num_sample_generations=0, kl_coef=0.1)
        trainer = PPOTrainer(args=args, processing_class=tok, model=policy, ref_model=ref, reward_model=reward,
                             value_model=value, train_dataset=Dataset.from_list(rows), callbacks=[Clock()])
        # the prompts in zeal's order (the spec lists each step's), not PPOTrainer's shuffled loader
        from torch.utils.data import DataLoader

        trainer.dataloader = trainer.accelerator.prepare(DataLoader(
            trainer.train_dataset, batch_size=trainer.local_dataloader_batch_size, shuffle=False,
            collate_fn=trainer.data_collator, drop_last=True))
        start = time.perf_counter()
        trainer.train()
        wall = time.perf_counter() - start
    return {"generate_s": times["generate"], "step_s": times["step"], "reward": times["scores"], "train_s": wall}


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    result = {"dpo": run_dpo, "rm": run_rm, "grpo": run_grpo, "ppo": run_ppo,
              "grpo_tools": run_grpo_tools}[spec["job"]](spec)
    import trl

    result["trl_version"] = trl.__version__
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
