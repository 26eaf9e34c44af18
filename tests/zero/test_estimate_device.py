"""``zeal estimate --budget`` proposes only plans zeal runs on the target device: each plan's
offload tiers pass the check ``zeal.initialize`` makes there. On a GPU every tier now crosses
to the host through staging buffers (offload_param cpu included, which before had no effect
there while the estimate subtracted the parameters from device memory, W1)."""

from __future__ import annotations

import json

from zeal.cli.main import main
from zeal.zero.estimate import all_plans, gpt_shape, implemented_on


def test_every_plan_is_implemented_on_cpu_and_gpu_and_offload_refused_elsewhere():
    plans = all_plans(gpt_shape(2, 64, 4, 512, 128), 2)
    assert {p.offload for p in plans} == {"none", "cpu_optimizer", "nvme_optimizer", "cpu_params", "nvme_params"}
    for p in plans:
        assert implemented_on(p, "cpu") and implemented_on(p, "gpu") and implemented_on(p, "cuda")
        assert implemented_on(p, "xpu") == (p.offload == "none")


def test_gpu_budget_that_only_parameter_offload_fits_recommends_it(capsys):
    # 1.3B parameters on one GPU: the device holds neither 16Ψ nor the 2Ψ + 2Ψ of stage 3 + optimizer offload
    # at 6 GB, but stage 3 with parameters and optimizer in host memory leaves only the working set there
    assert main(["estimate", "--n-layer", "24", "--n-embd", "2048", "--world-size", "1",
                 "--device", "gpu", "--budget", "4GB", "--checkpointing", "--micro-batch", "1", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    zo = data["recommended"]["zero_optimization"]
    assert zo["stage"] == 3 and zo.get("offload_param", {}).get("device") in ("cpu", "nvme")
