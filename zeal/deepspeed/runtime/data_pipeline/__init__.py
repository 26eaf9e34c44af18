"""``deepspeed.runtime.data_pipeline`` on zeal: ``data_routing.helper`` (random-LTD)."""
