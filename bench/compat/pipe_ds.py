"""A pipeline script in the style of DeepSpeedExamples' ``training/pipeline_parallelism``:
a ``PipelineModule`` over a layer list with ``num_stages=2`` and no pipeline section in
the config, the first layer of the second stage an in-place ReLU, ``train_batch`` over a
``RepeatingLoader``; synthetic classification data.

    torchrun --nproc_per_node 2 pipe_ds.py [--steps 20]"""

from __future__ import annotations

import argparse
import importlib
import os

import torch
import torch.nn as nn
from _side import Recorder, Tensors, import_deepspeed

deepspeed = import_deepspeed()
pipe = importlib.import_module(deepspeed.__name__ + ".pipe")


def repeating(loader):
    """``deepspeed.utils.RepeatingLoader`` where this side has it."""
    utils = getattr(deepspeed, "utils", None)
    if utils is not None and hasattr(utils, "RepeatingLoader"):
        return utils.RepeatingLoader(loader)

    def forever():
        while True:
            yield from loader
    return forever()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--local_rank", type=int, default=-1)
    p.add_argument("--zeal-pipeline-section", action="store_true",
                   help="zeal side: add zeal's pipeline_parallel section and start stage 2 without an in-place "
                        "layer (what zeal needs before num_stages alone sets the pipeline)")
    args = p.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(5)
    zeal_key = args.zeal_pipeline_section and os.environ.get("COMPAT_SIDE") == "zeal"
    layers = [nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(inplace=not args.zeal_pipeline_section),
              nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4)]
    net = pipe.PipelineModule(layers=layers, loss_fn=nn.CrossEntropyLoss(), num_stages=2,
                              partition_method="uniform")
    g = torch.Generator().manual_seed(6)
    data = Tensors(torch.randn(256, 16, generator=g), torch.randint(0, 4, (256,), generator=g))
    config = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "steps_per_print": 1000,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "gradient_clipping": 1.0}
    if zeal_key:
        config["pipeline_parallel"] = {"size": 2}
    engine, _, _, _ = deepspeed.initialize(model=net, model_parameters=[q for q in net.parameters() if q.requires_grad],
                                           config=config)
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=False)
    it = iter(repeating(loader))
    rec = Recorder(engine.global_rank)
    for _ in range(args.steps):
        rec.step(float(engine.train_batch(data_iter=it)))
    rec.finish()


if __name__ == "__main__":
    main()
