"""What every part of zeal may ask about the host: where the cache folder is
(:mod:`~zeal.utils.paths`), what the hardware computes natively
(:mod:`~zeal.utils.hardware`) and the process-wide settings a command applies
before it builds a model (:mod:`~zeal.utils.process`). Importing any of them
changes nothing in the process.
"""
