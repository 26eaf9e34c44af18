"""LoRA under tensor parallelism: TP 2 (2 gloo ranks) trains as PEFT in one process
(= TP 1), with gradient clipping acting on every step (so the tp gradient norm must
count split and replicated adapter factors right), and ``save_adapter`` assembles the
split factors into the same PEFT folder.

Tolerance: 1e-5 relative on losses (row-parallel partial sums add in another order);
1e-4 absolute on the trained adapter tensors: most agree to ~2e-6, but Adam turns an
element whose gradient is at rounding-noise level into an update of up to lr (1e-2) in
either direction, measured 3e-5 on one element; a wrong split or a missing tp
reduction moves whole tensors by ~lr."""

from __future__ import annotations

import pytest
import torch

from tests.dist_harness import run_ranks
from tests.lora.lora_cases import LR, WD, data, engine_config, peft_model, write_initial_adapter, zeal_model
from tests.needs import needs

pytestmark = needs("transformers", "peft")

CLIP = 0.05


def _reference():
    model = peft_model()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=WD)
    losses = []
    for per_rank in data():
        ids = torch.cat(per_rank)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        assert float(torch.nn.utils.clip_grad_norm_(params, CLIP)) > CLIP
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    lora = {n.removeprefix("base_model.model.").replace(".default", ""): p.detach().clone()
            for n, p in model.named_parameters() if p.requires_grad}
    return losses, lora


def _rank(rank, world, folder, out):
    import zeal

    engine = zeal.initialize(zeal_model(), engine_config(folder, 0, tensor_parallel={"autotp_size": 2},
                                                         gradient_clipping=CLIP))
    q = engine.module.model.layers[0].self_attn.q_proj
    o = engine.module.model.layers[0].self_attn.o_proj
    assert q.lora_B.weight.shape == (16, 4) and q.lora_A.weight.shape == (4, 32)  # column: B split
    assert o.lora_A.weight.shape == (4, 16) and o.lora_B.weight.shape == (32, 4)  # row: A split
    engine.train()
    losses = []
    for per_rank in data():
        ids = torch.cat(per_rank)  # dp 1: every tp rank sees the whole batch
        loss = engine(ids, labels=ids)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.save_adapter(out)
    engine.close()
    return losses


@pytest.mark.timeout(120)
def test_tp2_equals_peft_one_process(tmp_path):
    from zeal.lora.peft_folder import read_adapter_tensors

    write_initial_adapter(tmp_path / "init")
    want, lora = _reference()
    results = run_ranks(_rank, 2, str(tmp_path / "init"), str(tmp_path / "out"), timeout=100)
    for got in results:
        for i, (g, w) in enumerate(zip(got, want)):
            assert abs(g - w) <= 1e-5 * abs(w), f"step {i}: {got} vs {want}"
    saved = {k.removeprefix("base_model.model."): v for k, v in read_adapter_tensors(tmp_path / "out").items()}
    assert set(saved) == set(lora)
    for k, v in lora.items():
        torch.testing.assert_close(saved[k], v, rtol=0, atol=1e-4, msg=k)
