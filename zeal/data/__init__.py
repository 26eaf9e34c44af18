"""Data: text corpora, tokenizers and token datasets; curriculum schedules, samplers, random-LTD."""
