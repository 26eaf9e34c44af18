"""Model parallelism applied to a plain model before ZeRO: tensor parallelism
(:mod:`zeal.parallel.tensor`), the vocabulary-parallel embedding, head and cross-entropy
(:mod:`zeal.parallel.vocab`) and the tensor-parallel RNG tracker (:mod:`zeal.parallel.rng`)."""

from zeal.parallel.rng import RNGTracker, get_rng_tracker, model_parallel_seed
from zeal.parallel.tensor import Split, TensorParallel, apply_tensor_parallel
from zeal.parallel.vocab import VocabParallel, apply_vocab_parallel, vocab_parallel_cross_entropy

__all__ = ["RNGTracker", "Split", "TensorParallel", "VocabParallel", "apply_tensor_parallel", "apply_vocab_parallel",
           "get_rng_tracker", "model_parallel_seed", "vocab_parallel_cross_entropy"]
