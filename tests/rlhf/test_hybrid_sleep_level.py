"""The hybrid engine's sleep between rollouts (S8): when the caller loads new weights before the
next generation (PPO and distillation sync every step), the serving weights are discarded
(sleep level 2) instead of being copied to host memory (level 1 on an accelerator) only to be
overwritten after the copy back. Bytes copied to the host are counted from what the sleep kept;
on CPU the accelerator is simulated (``offloads_on_sleep``), the tokens equal the level-1 run's."""

from __future__ import annotations

import pytest

from tests.rlhf.test_hybrid import CFG, tiny_llama

pytestmark = pytest.mark.timeout(120)


def _hybrid(monkeypatch, accelerator: bool):
    import zeal
    from zeal.rlhf.hybrid import HybridEngine

    engine = zeal.initialize(tiny_llama(), CFG)
    monkeypatch.setattr(HybridEngine, "offloads_on_sleep", lambda self: accelerator)
    return engine, HybridEngine(engine, kv_cache_bytes=1 << 20)


def _host_bytes(hybrid) -> int:
    rel = hybrid.llm.engine._weights_released
    return sum(h.numel() * h.element_size() for _, h in rel.host_copies)


def test_rollouts_that_are_reloaded_discard_the_weights(monkeypatch):
    from zeal.inference.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [[1, 2, 3], [5, 9, 11]]
    _, ref = _hybrid(monkeypatch, accelerator=False)
    want = [o.output_ids for o in ref.generate(prompts, params)] + [o.output_ids for o in ref.generate(prompts, params)]
    assert ref.llm.engine.sleep_level == 1  # CPU: level 1 copies nothing, so it stays
    assert ref.sleep_level(reload_next=True) == 1

    engine, hybrid = _hybrid(monkeypatch, accelerator=True)
    got = [o.output_ids for o in hybrid.generate(prompts, params, reload_next=True)]
    eng = hybrid.llm.engine
    assert eng.sleep_level == 2 and _host_bytes(hybrid) == 0  # nothing copied out
    assert all(p.untyped_storage().nbytes() == 0 for p in eng.runner.model.parameters())  # released, not kept
    got += [o.output_ids for o in hybrid.generate(prompts, params)]  # the sync loads the weights again
    assert got == want
    assert hybrid.sleep_level(reload_next=False) == 1  # generating again with the same weights: kept
    with pytest.raises(Exception, match="discarded"):  # reload_next broken: a clear error, not garbage
        hybrid.generate(prompts, params, reload_next=True)
        hybrid.generate(prompts, params, sync=False)

