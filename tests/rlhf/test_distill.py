"""On-policy distillation (zeal.rlhf.distillation): the advantages are the negative per-token
reverse KL; a student trained on a teacher's log-probs over its own samples lowers the
reverse KL (exact, over the vocabulary on fixed probe sequences; seeded, with a margin)."""

import pytest
import torch

pytestmark = pytest.mark.timeout(120)


def test_reverse_kl_advantages():
    from zeal.rlhf.distillation import reverse_kl_advantages

    s = torch.tensor([[-1.0, -2.0, -0.5]])
    t = torch.tensor([[-1.5, -1.0, -9.0]])
    m = torch.tensor([[1.0, 1.0, 0.0]])
    torch.testing.assert_close(reverse_kl_advantages(s, t, m), torch.tensor([[-0.5, 1.0, 0.0]]))


def _exact_reverse_kl(student, teacher, ids):
    """KL(π_s ‖ π_t) over the whole vocabulary, averaged over every position of ``ids``."""
    with torch.no_grad():
        s = torch.log_softmax(student(ids).float(), -1)
        t = torch.log_softmax(teacher(ids).float(), -1)
    return float((s.exp() * (s - t)).sum(-1).mean())


def test_student_reverse_kl_falls(tmp_path):
    import copy

    from tests.rlhf.test_e2e import PROMPTS, tiny
    from zeal.rlhf import distill

    student = tiny()
    teacher = copy.deepcopy(student)
    with torch.no_grad():  # a teacher that strongly prefers token 7
        teacher.lm_head.weight[7] += 2.0
    probe = torch.randint(0, 16, (8, 10), generator=torch.Generator().manual_seed(3))
    before = _exact_reverse_kl(student, teacher, probe)
    cfg = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "rlhf": {"steps": 15, "batch_size": 4, "num_generations": 4, "max_new_tokens": 6,
                    "generation_dtype": "fp32"}}
    res = distill(student, teacher, PROMPTS, cfg, out=str(tmp_path))
    after = _exact_reverse_kl(res.engine.module, teacher, probe)
    assert after < before - 0.06, (before, after)  # 1.51 -> 1.40 measured (seeds 0-2: 1.40, 1.41, 1.43)
    assert all(r["reverse_kl"] == r["reverse_kl"] for r in res.metrics)  # logged, finite
