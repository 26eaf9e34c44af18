"""Model parallelism applied to a plain model before ZeRO: tensor parallelism
(:mod:`zeal.parallel.tensor`)."""

from zeal.parallel.tensor import Split, TensorParallel, apply_tensor_parallel

__all__ = ["Split", "TensorParallel", "apply_tensor_parallel"]
