"""Checkpoint state that is not model or optimizer tensors: RNG states (Python,
NumPy, torch, CUDA) as JSON, and the user's client state, whose tensors travel in
safetensors while the rest stays JSON."""

from __future__ import annotations

import base64
import random
from collections.abc import Callable
from typing import Any

import torch

from zeal.checkpoint.files import CheckpointError, TensorSpec


def rng_state() -> dict:
    """This process's RNG states, JSON-able."""
    py = random.getstate()
    out: dict = {"python": [py[0], list(py[1]), py[2]],
                 "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}
    try:
        import numpy as np

        s = np.random.get_state()
        out["numpy"] = [s[0], s[1].tolist(), int(s[2]), int(s[3]), float(s[4])]
    except ImportError:
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = base64.b64encode(torch.cuda.get_rng_state().numpy().tobytes()).decode()
    return out


def rng_problem(s: Any) -> str | None:
    """What is malformed in a saved RNG state (None when :func:`set_rng_state` will take
    it); checked on private generators, so nothing global changes."""
    try:
        py = s["python"]
        if not (isinstance(py, list) and len(py) == 3 and isinstance(py[1], list)):
            return "python state is not [version, [ints], gauss]"
        random.Random().setstate((py[0], tuple(py[1]), py[2]))
        if len(base64.b64decode(s["torch"], validate=True)) != torch.get_rng_state().numel():
            return "torch state has the wrong size"
        if "numpy" in s:
            import numpy as np

            n = s["numpy"]
            np.random.RandomState().set_state((n[0], np.array(n[1], dtype=np.uint32), n[2], n[3], n[4]))
        if "cuda" in s:
            base64.b64decode(s["cuda"], validate=True)
    except (KeyError, TypeError, ValueError, IndexError, OverflowError) as e:  # binascii.Error is a ValueError
        return f"{type(e).__name__}: {e}"
    return None


def set_rng_state(s: dict) -> None:
    """Restore what :func:`rng_state` returned."""
    random.setstate((s["python"][0], tuple(s["python"][1]), s["python"][2]))
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(s["torch"])), dtype=torch.uint8))
    if "numpy" in s:
        import numpy as np

        n = s["numpy"]
        np.random.set_state((n[0], np.array(n[1], dtype=np.uint32), n[2], n[3], n[4]))
    if "cuda" in s and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(s["cuda"])), dtype=torch.uint8))


def split_client(obj: Any, tensors: list[TensorSpec], path: str = "client_state") -> Any:
    """JSON skeleton of ``obj``; its tensors are appended to ``tensors`` and referenced by key."""
    if isinstance(obj, torch.Tensor):
        key = f"client/{len(tensors)}"
        t = obj.detach().cpu()
        tensors.append(TensorSpec(key, t.dtype, tuple(t.shape), lambda t=t: t))
        return {"__tensor__": key}
    if isinstance(obj, dict):
        if not all(isinstance(k, str) for k in obj):
            raise CheckpointError(f"{path}: dictionary keys must be strings")
        return {k: split_client(v, tensors, f"{path}[{k!r}]") for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [split_client(v, tensors, f"{path}[{i}]") for i, v in enumerate(obj)]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise CheckpointError(f"{path}: {type(obj).__name__} is not JSON-serialisable (use numbers, strings, "
                          "lists, dicts or tensors)")


def join_client(obj: Any, get_tensor: Callable[[str], torch.Tensor]) -> Any:
    """Inverse of :func:`split_client`, reading tensors by key through ``get_tensor``."""
    if isinstance(obj, dict):
        if set(obj) == {"__tensor__"}:
            return get_tensor(obj["__tensor__"])
        return {k: join_client(v, get_tensor) for k, v in obj.items()}
    if isinstance(obj, list):
        return [join_client(v, get_tensor) for v in obj]
    return obj
