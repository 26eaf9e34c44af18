"""Verifiable rewards: reward functions loaded by name (``module:function``), a math answer
checker, and unit tests of generated code run in a separate Python process (a timeout,
memory and CPU limits, no network, no shell). Every reward function has the GRPO shape
``fn(prompts, completions, **kwargs) -> list[float]``; a prompt given as a dict carries
its row's fields (``answer``, ``tests``)."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from fractions import Fraction

_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:/\d+)?")


def load_callable(spec: str) -> Callable:
    """The function ``module:function`` names (``ValueError`` naming what is missing)."""
    if ":" not in spec:
        raise ValueError(f"reward {spec!r}: expected module:function")
    mod, name = spec.split(":", 1)
    try:
        fn = getattr(importlib.import_module(mod), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"reward {spec!r}: {e}") from None
    if not callable(fn):
        raise ValueError(f"reward {spec!r} is not callable")
    return fn


def _field(prompt, key: str, kwargs: dict, i: int):
    if isinstance(prompt, dict) and key in prompt:
        return prompt[key]
    vals = kwargs.get(key)
    return vals[i] if isinstance(vals, (list, tuple)) else None


def extract_answer(text: str) -> Fraction | None:
    """The final answer of a solution: the last ``\\boxed{...}`` if any, else the last
    number (integers, decimals, fractions ``a/b``), as an exact fraction."""
    boxed = _BOXED.findall(text or "")
    pool = boxed[-1] if boxed else (text or "")
    nums = _NUMBER.findall(pool.replace(",", ""))
    if not nums:
        return None
    try:
        return Fraction(nums[-1])
    except (ValueError, ZeroDivisionError):
        return None


def math_answer_reward(prompts, completions, **kwargs) -> list[float]:
    """1.0 where the completion's final answer (:func:`extract_answer`) equals the row's
    ``answer`` exactly as a number (``0.5`` = ``1/2``), else 0.0."""
    out = []
    for i, (p, c) in enumerate(zip(prompts, completions)):
        want = _field(p, "answer", kwargs, i)
        got = extract_answer(c)
        try:
            ok = want is not None and got is not None and got == Fraction(str(want))
        except (ValueError, ZeroDivisionError):
            ok = False
        out.append(1.0 if ok else 0.0)
    return out


_CODE_BLOCK = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.S)

# run in the child before the candidate code: no sockets (no network), limits on memory and CPU time
_PRELUDE = """
import resource, socket, sys
resource.setrlimit(resource.RLIMIT_AS, ({mem}, {mem}))
resource.setrlimit(resource.RLIMIT_CPU, ({cpu}, {cpu}))
def _no_network(*a, **k):
    raise OSError("network access is disabled in reward sandboxes")
socket.socket = _no_network
socket.create_connection = _no_network
socket.getaddrinfo = _no_network
del _no_network
"""


def extract_code(text: str) -> str:
    """The last fenced Python block of ``text``, or the whole text."""
    blocks = _CODE_BLOCK.findall(text or "")
    return blocks[-1] if blocks else (text or "")


def run_tests(code: str, tests: str, timeout: float = 5.0, memory_mb: int = 512) -> bool:
    """Whether ``code`` followed by ``tests`` (asserts) exits 0 in a fresh ``python -I``
    process within ``timeout`` seconds: no shell, an empty environment, a temporary
    working folder, sockets disabled, address space and CPU time limited."""
    program = _PRELUDE.format(mem=memory_mb << 20, cpu=max(1, int(timeout) + 1)) + "\n" + code + "\n\n" + tests + "\n"
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "candidate.py")
        with open(path, "w") as f:
            f.write(program)
        try:
            r = subprocess.run([sys.executable, "-I", path], cwd=d, env={"PATH": "/usr/bin:/bin"},
                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               timeout=timeout, check=False)
        except subprocess.TimeoutExpired:
            return False
    return r.returncode == 0


def code_tests_reward(prompts, completions, **kwargs) -> list[float]:
    """1.0 where the completion's code (:func:`extract_code`) passes the row's ``tests``
    (Python asserts, a string or a list of strings) in :func:`run_tests`, else 0.0."""
    out = []
    for i, (p, c) in enumerate(zip(prompts, completions)):
        tests = _field(p, "tests", kwargs, i)
        if isinstance(tests, list):
            tests = "\n".join(tests)
        out.append(1.0 if tests and run_tests(extract_code(c), str(tests)) else 0.0)
    return out



VERIFIERS: dict[str, Callable] = {"math": math_answer_reward, "code": code_tests_reward}


def config_rewards(reward_fn, rc) -> list[Callable] | Callable | None:
    """``reward_fn`` (a function, a list, or None) with the config's verifiers
    (``rc.verifiers``, names of :data:`VERIFIERS`) and ``rc.reward_funcs``
    (``module:function``) appended; ``reward_fn`` itself when the config adds none."""
    unknown = [v for v in rc.verifiers if v not in VERIFIERS]
    if unknown:
        raise ValueError(f"verifiers: unknown verifier {unknown[0]!r} (known: {', '.join(VERIFIERS)})")
    extra = [VERIFIERS[v] for v in rc.verifiers] + [load_callable(spec) for spec in rc.reward_funcs]
    if not extra:
        return reward_fn
    base = [] if reward_fn is None else list(reward_fn) if isinstance(reward_fn, (list, tuple)) else [reward_fn]
    return base + extra
