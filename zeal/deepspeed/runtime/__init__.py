"""``deepspeed.runtime`` on zeal: only the parts scripts import (``data_pipeline``)."""
