"""``deepspeed.runtime.data_pipeline.data_routing`` on zeal (see :mod:`zeal.data.random_ltd`)."""
