"""``deepspeed.runtime.data_pipeline.data_routing.helper``: random-LTD's helpers, from
:mod:`zeal.data.random_ltd`, so ``from deepspeed.runtime.data_pipeline.data_routing.helper
import convert_to_random_ltd, save_without_random_ltd`` ports by changing ``deepspeed`` to
``zeal.deepspeed``."""

from zeal.data.random_ltd import convert_to_random_ltd, remove_random_ltd_state_dict, save_without_random_ltd

__all__ = ["convert_to_random_ltd", "remove_random_ltd_state_dict", "save_without_random_ltd"]
