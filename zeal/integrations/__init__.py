"""Integrations of zeal's engine with other libraries' training loops.

:mod:`zeal.integrations.transformers` — ``ZealTrainer``, a Hugging Face ``Trainer`` that
trains through zeal's engine.
"""
