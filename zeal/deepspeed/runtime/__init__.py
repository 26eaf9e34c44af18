"""``deepspeed.runtime`` on zeal: the modules scripts and libraries reach through it
(``utils``, ``lr_schedules``, ``zero``, ``pipe``, ``engine``, ``activation_checkpointing``,
``dataloader``, ``data_pipeline``), imported with it as DeepSpeed's are."""

from zeal.deepspeed.runtime import (  # noqa: F401 - attributes of deepspeed.runtime, as in DeepSpeed
    activation_checkpointing,
    data_pipeline,
    dataloader,
    engine,
    lr_schedules,
    pipe,
    utils,
    zero,
)
