"""Pipeline parallelism on real gloo ranks matches the single-process run.

Reference: one process, the whole model from the same seed, for every optimizer step
the M micro-batches (each the concatenation of the data-parallel ranks' micro-batches)
accumulated with loss / M, ``clip_grad_norm_``, AdamW. The pipeline run: ZeRO stage 1
over the data-parallel ranks of each stage, fp32, the same micro-batches through
``engine.train_batch``. Losses agree to fp32 rounding (1e-5: summation orders differ);
clipping is active in every run (the reference's norms exceed the clip).

Models: a zeal GPT with its head tied to the embedding (cut between blocks; the tied
weight crosses from the first stage to the last), a zeal Llama without tying (GPipe,
activation checkpointing in each stage), and a
``PipelineModule`` of ``LayerSpec`` layers partitioned by parameter counts.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.dist_harness import run_ranks

STEPS, M, MICRO, T, LR, CLIP = 5, 4, 2, 8, 1e-2, 0.05
VOCAB = 64


def _gpt():
    from zeal.models.gpt import GPT, GPTConfig

    return GPT(GPTConfig(vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=4, n_head=2))


def _llama():
    from zeal.models.llama import Llama, LlamaConfig

    return Llama(LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16))


class Head(nn.Module):
    def __init__(self, dim: int, vocab: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, vocab)

    def forward(self, x):
        return self.out(self.norm(x))


def _layers(num_stages: int, stage_id: int | None = None):
    from zeal.pipe import LayerSpec, PipelineModule

    layers = [LayerSpec(nn.Embedding, VOCAB, 16), LayerSpec(nn.Linear, 16, 48), torch.tanh,
              LayerSpec(nn.Linear, 48, 16), nn.GELU(), LayerSpec(nn.Linear, 16, 16), LayerSpec(Head, 16, VOCAB)]
    return PipelineModule(layers, loss_fn=_seq_loss, num_stages=num_stages, partition_method="parameters",
                          stage_id=stage_id, seed_layers=True)


def _seq_loss(logits, labels):
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


MODELS = {"gpt": _gpt, "llama": _llama, "layers": lambda: _layers(1, 0)}


def _data(dp: int):
    g = torch.Generator().manual_seed(7)
    x = torch.randint(0, VOCAB, (STEPS, M, dp, MICRO, T), generator=g)
    y = torch.randint(0, VOCAB, (STEPS, M, dp, MICRO, T), generator=g)
    return x, y


def _reference(name: str, dp: int):
    torch.manual_seed(0)
    model = MODELS[name]()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    x, y = _data(dp)
    losses, norms = [], []
    for s in range(STEPS):
        total = 0.0
        for m in range(M):
            xb, yb = x[s, m].reshape(-1, T), (x if name != "layers" else y)[s, m].reshape(-1, T)
            loss = model(xb) if name == "layers" else model(xb, yb)
            loss = _seq_loss(loss, yb) if name == "layers" else loss
            (loss / M).backward()
            total += loss.item() / M
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, norms


def _config(pp: int, schedule: str, checkpointing: bool = False) -> dict:
    return {**({"activation_checkpointing": {}} if checkpointing else {}),"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": M,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.1}},
            "gradient_clipping": CLIP, "zero_optimization": {"stage": 1, "reduce_bucket_size": 500},
            "pipeline_parallel": {"size": pp, "micro_batches": M, "schedule": schedule}}


def _train(rank: int, world: int, pp: int, runs: list[tuple[str, str]]):
    import zeal

    out = {}
    dp = world // pp
    for name, schedule in runs:
        torch.manual_seed(0)
        model = _layers(pp) if name == "layers" else MODELS[name]()
        engine = zeal.initialize(model, _config(pp, schedule, checkpointing=name == "llama"))
        x, y = _data(dp)
        labels = y if name == "layers" else x
        d = engine.mesh.dp_rank
        losses, norms = [], []
        for s in range(STEPS):
            it = iter([(x[s, m, d], labels[s, m, d]) for m in range(M)])
            losses.append(float(engine.train_batch(it)))
            norms.append(engine.grad_norm)
        out[f"{name}/{schedule}"] = (losses, norms, engine.comm_stats()["total"]["by_dim"].get("pp", {}))
    return out


def _check(results, pp: int, runs) -> None:
    world = len(results)
    for name, schedule in runs:
        ref_losses, ref_norms = _reference(name, world // pp)
        assert max(ref_norms) > CLIP, "the test must exercise clipping"
        for r in range(world):
            losses, norms, pp_bytes = results[r][f"{name}/{schedule}"]
            assert losses == pytest.approx(ref_losses, abs=1e-5, rel=0), (name, schedule, r)
            assert norms == pytest.approx(ref_norms, rel=1e-4), (name, schedule, r)
            assert pp_bytes["bytes"] > 0  # activations crossed through the accounted pp Comm


@pytest.mark.timeout(120)
def test_pp2_matches_single_process():
    runs = [("gpt", "1f1b"), ("llama", "gpipe"), ("layers", "1f1b")]
    _check(run_ranks(_train, 2, 2, runs, timeout=100), 2, runs)


@pytest.mark.timeout(150)
def test_pp2_dp2_matches_single_process():
    runs = [("gpt", "1f1b")]
    _check(run_ranks(_train, 4, 2, runs, timeout=130), 2, runs)


def _save_midway(rank: int, world: int, folder: str):
    import zeal

    torch.manual_seed(0)
    engine = zeal.initialize(_gpt(), _config(2, "1f1b"))
    x, _ = _data(1)
    losses = []
    for s in range(STEPS):
        if s == 3:
            engine.save_checkpoint(folder, tag="mid")
        losses.append(float(engine.train_batch(iter([(x[s, m, 0], x[s, m, 0]) for m in range(M)]))))
    engine.load_checkpoint(folder, tag="mid")  # back into the same stages: the same two steps again
    again = [float(engine.train_batch(iter([(x[s, m, 0], x[s, m, 0]) for m in range(M)]))) for s in (3, 4)]
    return losses, again


@pytest.mark.timeout(120)
def test_pp2_checkpoint_loads_without_pipeline(tmp_path):
    """Saved by 2 stages after 3 steps, loaded by one process (no pipeline): steps 4 and 5
    give the pipeline run's losses (the optimizer moments travelled too: Adam's update
    would differ otherwise). Loaded back into the 2 stages, they repeat those steps."""
    import zeal

    pp_losses, again = run_ranks(_save_midway, 2, str(tmp_path), timeout=100)[0]
    assert again == pytest.approx(pp_losses[3:], abs=1e-6)
    config = _config(1, "1f1b")
    del config["pipeline_parallel"]
    engine = zeal.initialize(_gpt(), config)
    engine.load_checkpoint(str(tmp_path), tag="mid")
    assert engine.global_steps == 3
    x, _ = _data(1)
    for s in (3, 4):
        total = 0.0
        for m in range(M):
            loss = engine((x[s, m, 0], x[s, m, 0]))
            engine.backward(loss)
            engine.step()
            total += loss.item() / M
        assert total == pytest.approx(pp_losses[s], abs=1e-5)
    engine.close()
