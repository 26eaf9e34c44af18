"""``deepspeed.runtime.sequence_parallel`` on zeal: ALST's Hugging Face entry points
(``ulysses_sp``: ``UlyssesSPAttentionHF``, ``UlyssesSPDataLoaderAdapter``) and the
sequence-parallel ``mpu`` they return (``parallel_state_sp``), which Accelerate and TRL
import, reaching zeal's Ulysses sequence parallelism (:mod:`zeal.parallel.sequence`)."""
