"""The vLLM side of ``check_export_peers.py``: run in vLLM's own venv (never a zeal
dependency). ``python _vllm_load_side.py JOB.json RESULT.json``.

Loads each folder zeal exported (one ``LLM`` after the other, eager mode: the check is
the loader and the tokens, not speed), greedy-decodes the same token prompts and scores the
held-out blocks (prompt logprobs), or records the exact error when vLLM refuses it. The engine runs in this
process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so a loader's exception reaches us as is.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback


def _error(e: BaseException) -> str:
    while e.__cause__ is not None:  # the root cause, not the engine's wrapper
        e = e.__cause__
    lines = [x for x in str(e).strip().splitlines() if x.strip()]
    where = traceback.extract_tb(e.__traceback__)[-1] if e.__traceback__ else None
    at = f" [{os.path.basename(where.filename)}:{where.lineno}]" if where else ""
    return f"{type(e).__name__}: {' | '.join(x.strip() for x in lines)[:700]}{at}"


def _scored(llm, blocks: list[list[int]], TokensPrompt, SamplingParams) -> list[list[float]]:
    """log p(token_t | tokens_<t) of every block token after the first (vLLM's prompt logprobs)."""
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=b) for b in blocks], params, use_tqdm=False)
    return [[o.prompt_logprobs[t][tok].logprob for t, tok in enumerate(b) if t > 0] for o, b in zip(outs, blocks)]


def main() -> int:
    job = json.loads(open(sys.argv[1]).read())
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=job["new_tokens"], temperature=0.0, ignore_eos=True, detokenize=False)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]
    out = {"vllm": vllm.__version__, "runs": {}}
    for name, folder in job["folders"].items():
        t0 = time.perf_counter()
        llm = None
        try:
            llm = LLM(model=folder, dtype=job["dtype"], skip_tokenizer_init=True, max_model_len=256, seed=0,
                      enforce_eager=True)
            outs = llm.generate(prompts, params, use_tqdm=False)
            out["runs"][name] = {"tokens": [list(o.outputs[0].token_ids) for o in outs],
                                 "logprobs": _scored(llm, job["score"], TokensPrompt, SamplingParams)}
        except Exception as e:  # a refusal is the result
            out["runs"][name] = {"error": _error(e)}
        out["runs"][name]["seconds"] = time.perf_counter() - t0
        print(f"vllm {name}: {out['runs'][name]}", flush=True)
        del llm
        gc.collect()
    with open(sys.argv[2], "w") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
