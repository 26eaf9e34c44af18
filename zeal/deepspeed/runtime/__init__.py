"""``deepspeed.runtime`` on zeal: the modules scripts import (``utils``, ``lr_schedules``,
``zero``, ``pipe``, ``engine``, ``activation_checkpointing``, ``dataloader``,
``data_pipeline``)."""
