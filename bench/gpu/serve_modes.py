"""The serving stage's decode modes (issue 37): async scheduling on/off x the decode step
compiled/eager, each mode's tokens/s on one workload and its greedy tokens against the
synchronous eager ones (``stages.py serve_speed``; ``--dry-run`` covers the paths on CPU)."""

from __future__ import annotations

import os
import time

# (async_scheduling, compilation_config) per row of decode_modes; graphs stay as the device sets them
DECODE_MODES = {"async+compiled": (True, 3), "async+eager": (True, 0), "sync+compiled": (False, 3),
                "sync+eager": (False, 0)}


def decode_modes(path: str, dtype, device, prompts: list, params, dry: bool, sync, free, err) -> dict:
    """Tokens/s of the workload with async scheduling on/off and the decode step compiled or
    eager (each mode's greedy tokens against the sync+eager ones). Dry run: two prompts,
    async on/off through the accelerator's path on the CPU (flex, packed inputs, fake decode
    graphs); the compiled modes are skipped there. ``sync``, ``free``, ``err``: stages.py's helpers
    (wait for the device, free its memory, an exception as one line)."""
    from zeal.inference import LLM
    from zeal.inference.cuda_graphs import FakeGraph

    if dry:
        prompts, params = prompts[:2], type(params)(max_tokens=4, temperature=0.0, ignore_eos=True)
    rows: dict = {}
    ref = None
    names = sorted(DECODE_MODES, key=lambda m: m != "sync+eager")  # the reference first
    if dry:  # a compile takes ~10 s even at toy size: the compiled step's CPU check is
        # tests/inference/test_compiled_decode.py's (as train_speed's dry run skips its compiled runs)
        for name in [n for n in names if "compiled" in n]:
            names.remove(name)
            rows[name] = {"skipped": "dry run"}
    for name in names:
        asy, level = DECODE_MODES[name]
        flex = dry and level == 0  # compiled on CPU: the fused kernels' path (compiled_decode)
        old = os.environ.get("ZEAL_ATTENTION_BACKEND")
        try:
            if flex:
                os.environ["ZEAL_ATTENTION_BACKEND"] = "flex"
            kw = {"num_blocks": 64, "block_size": 16} if dry else {}
            llm = LLM(path, dtype=dtype, device=str(device), async_scheduling=asy, compilation_config=level, **kw)
            if flex:
                llm.engine.runner.enable_decode_graphs(8, llm.engine.max_seq_tokens, graph_factory=FakeGraph)
            llm.generate(prompts[:2], type(params)(max_tokens=4, temperature=0.0, ignore_eos=True))  # warm-up
            sync(device)
            t = time.perf_counter()
            got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
            sync(device)
            dt = time.perf_counter() - t
            ref = got if ref is None else ref
            g = llm.engine.runner.graphs
            rows[name] = {"tokens_per_s": round(sum(map(len, got)) / dt, 1),
                          "greedy_equal": f"{sum(int(a == b) for a, b in zip(got, ref))}/{len(got)}",
                          "graphs": dict(g.stats) if g is not None else None,
                          "compile_failed": getattr(g.forward, "failed", None) if g is not None else None}
            llm.shutdown()
            del llm
            free(device)
        except Exception as e:  # noqa: BLE001 - reported
            rows[name] = {"error": err(e)}
        finally:
            if old is None:
                os.environ.pop("ZEAL_ATTENTION_BACKEND", None)
            else:
                os.environ["ZEAL_ATTENTION_BACKEND"] = old
    return rows


