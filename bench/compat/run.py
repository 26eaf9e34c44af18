"""Run each comparison script once on DeepSpeed itself and once on zeal, same seeds and
data, and print per-step losses of both, their largest relative difference and the step
time zeal/DeepSpeed; a table at the end.

    python bench/compat/run.py [--only NAME ...] [--steps 20]
        [--ds-python /work/peers/ds/bin/python] [--zeal-python <this python>]

DeepSpeed runs in its own virtual environment with ``DS_ACCELERATOR=cpu`` (see
README.md); zeal runs with this repository first on ``PYTHONPATH``. Ranks are started by
torchrun on both sides. Run it under the machine's CPU lock: it is one heavy job."""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO / "bench"))
from _shared import clear_stale_extension_locks  # noqa: E402

# fp32: the target; bf16 and MoE/pipeline: tolerances justified in README.md
FP32_TOL = 1e-5
BF16_TOL = 2e-2
MOE_TOL = 1e-5


@dataclass
class Case:
    name: str
    script: str
    api: str
    ranks: int
    stage: int | str
    args: list[str] = field(default_factory=list)
    tol: float = FP32_TOL
    refused: str = ""  # zeal refuses it by design: why (counted apart)
    switch: bool = False  # zeal side under the `import deepspeed` switch (the script never names zeal)


def cases(steps: int) -> list[Case]:
    s = ["--steps", str(steps)]
    out = []
    for ranks in (1, 2):
        for stage in (0, 1, 2, 3):
            out.append(Case(f"cifar-z{stage}-r{ranks}", "cifar_ds.py", "initialize(training_data), Adam, WarmupLR, clip",
                            ranks, stage, ["--stage", str(stage), *s]))
    out.append(Case("cifar-z2-r2-accum2", "cifar_ds.py", "as above, gradient_accumulation_steps 2", 2, 2,
                    ["--stage", "2", "--accum", "2", *s]))
    out.append(Case("cifar-moe-r1", "cifar_ds.py", "moe.layer.MoE top-1, moe.utils param groups", 1, 0,
                    ["--moe", "--stage", "0", *s], MOE_TOL))
    out.append(Case("cifar-moe-ep2-r2", "cifar_ds.py", "MoE, ep_size 2 (expert parallel)", 2, 0,
                    ["--moe", "--ep-world-size", "2", "--stage", "0", *s], MOE_TOL))
    out.append(Case("bert-bf16-z1-offload", "bert_ds.py", "HF BERT MLM, bf16, ZeRO-1 + CPU Adam offload", 1, 1,
                    ["--stage", "1", "--offload", *s], BF16_TOL))
    out.append(Case("bert-bf16-z2-r2", "bert_ds.py", "HF BERT MLM, bf16, ZeRO-2", 2, 2, ["--stage", "2", *s], BF16_TOL))
    out.append(Case("refused-dynamic-batching", "cifar_ds.py",
                    "data_efficiency.data_sampling.dynamic_batching (variable_batch_size_and_lr)", 1, 0,
                    ["--stage", "0", "--dynamic-batching", *s], refused="dynamic batching"))
    out.append(Case("refused-offload-states", "cifar_ds.py", "engine.offload_states() / reload_states()", 1, 3,
                    ["--stage", "3", "--offload-states", *s], refused="offload_states"))
    for ranks, stage in ((1, 2), (2, 2), (2, 3)):
        out.append(Case(f"chat-sft-z{stage}-r{ranks}", "chat_ds.py",
                        "DS-Chat step 1: OPT SFT, client FusedAdam groups, HF cosine schedule", ranks, stage,
                        ["--step", "sft", "--stage", str(stage), *s]))
    out.append(Case("chat-reward-z2-r2", "chat_ds.py", "DS-Chat step 2: OPT reward model, pairwise loss", 2, 2,
                    ["--step", "reward", "--stage", "2", *s]))
    out.append(Case("pipe-2stages", "pipe_ds.py", "pipe.PipelineModule(num_stages=2), in-place ReLU, train_batch",
                    2, "pp2", [*s]))
    out.append(Case("pipe-2stages-zealkey", "pipe_ds.py", "as above + zeal's pipeline_parallel section, no in-place",
                    2, "pp2", ["--zeal-pipeline-section", *s]))
    half = str(max(1, steps // 2))
    for ranks, stage, extra in ((1, 2, ["--resume-at", half]), (2, 2, []), (1, 3, []), (2, 3, ["--resume-at", half]),
                                (2, 2, ["--ds-optimizer"])):
        what = "HF Trainer, TrainingArguments(deepspeed=dict with auto), " + (
            "DS AdamW + WarmupDecayLR (DummyOptim)" if extra == ["--ds-optimizer"] else "HF AdamW + linear schedule")
        if extra and extra[0] == "--resume-at":
            what += f"; save at step {half}, then resume_from_checkpoint (the later steps again)"
        name = f"hf-trainer-z{stage}-r{ranks}" + ("-dsopt" if "--ds-optimizer" in extra else "") + (
            "-resume" if "--resume-at" in extra else "")
        out.append(Case(name, "hf_trainer_ds.py", what, ranks, stage, ["--stage", str(stage), *extra, *s],
                        switch=True))
    for ranks, stage in ((1, 0), (2, 3)):
        out.append(Case(f"hf-trainer-peft-z{stage}-r{ranks}-resume", "hf_trainer_ds.py",
                        "HF Trainer, peft.get_peft_model (LoRA q/v): adapters only; save, resume_from_checkpoint",
                        ranks, stage, ["--stage", str(stage), "--peft", "--resume-at", half, *s], switch=True))
    return out


def _port() -> int:
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        return sk.getsockname()[1]


def run_side(case: Case, side: str, python: str, timeout: int) -> dict:
    env = dict(os.environ, COMPAT_SIDE=side, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(REPO), str(HERE)] if side == "zeal" else [str(HERE)]))
    if side == "zeal" and case.switch:  # what `zeal deepspeed` / ZEAL_DEEPSPEED=1 does for torchrun
        env.update(ZEAL_DEEPSPEED="1", PYTHONPATH=os.pathsep.join([str(REPO / "zeal" / "deepspeed" / "_site"),
                                                                    env["PYTHONPATH"]]))
    cmd = [python, "-m", "torch.distributed.run", "--nproc_per_node", str(case.ranks), "--master_port", str(_port()),
           case.script, *case.args]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=HERE, env=env, capture_output=True, text=True, timeout=timeout)
        out, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        out, rc = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""), "timeout"
    for line in out.splitlines():
        if line.startswith("COMPAT_RESULT "):
            res = json.loads(line.split(" ", 1)[1])
            res["wall_s"] = time.perf_counter() - t0
            return res
    raised = [ln.strip() for ln in out.splitlines()  # the exception a rank raised, not torchrun's summary
              if re.match(r"^\s*(\[rank\d+\]:\s*)?[\w.]+(Error|Exception|Refused): ", ln) and "ChildFailed" not in ln]
    tail = raised[-1:] or [ln for ln in out.splitlines() if ln.strip()][-3:]
    return {"error": f"rc={rc}: " + " | ".join(t.strip()[:300] for t in tail)}


def max_rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="*", help="case names (prefixes) to run")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--ds-python", default="/work/peers/ds/bin/python")
    ap.add_argument("--zeal-python", default=sys.executable)
    ap.add_argument("--timeout", type=int, default=900, help="seconds per side")
    ap.add_argument("--json", help="also write the rows here")
    ap.add_argument("--budget-s", type=float, default=0,
                    help="start no new case after this many seconds (0: no limit); the rest are listed as not run")
    a = ap.parse_args()
    clear_stale_extension_locks()
    rows = []
    t_start = time.perf_counter()
    for case in cases(a.steps):
        if a.only and not any(case.name.startswith(o) for o in a.only):
            continue
        if a.budget_s and time.perf_counter() - t_start > a.budget_s:
            rows.append({"case": case.name, "api": case.api, "ranks": case.ranks, "stage": case.stage,
                         "tol": case.tol, "result": "not run (time budget)"})
            continue
        ds = run_side(case, "deepspeed", a.ds_python, a.timeout)
        zl = run_side(case, "zeal", a.zeal_python, a.timeout)
        row = {"case": case.name, "api": case.api, "ranks": case.ranks, "stage": case.stage, "tol": case.tol,
               "wall_s": {"deepspeed": ds.get("wall_s"), "zeal": zl.get("wall_s")}}
        print(f"== {case.name} ({case.script} {' '.join(case.args)}; {case.ranks} rank(s)) "
              f"[{time.perf_counter() - t_start:.0f} s into the run]", flush=True)
        for side, res in (("deepspeed", ds), ("zeal", zl)):
            print(f"   {side:9s} " + (res.get("error") or " ".join(f"{x:.6f}" for x in res["losses"])), flush=True)
        if case.refused:  # counted apart: zeal must stop at the call, in one line naming it
            said = zl.get("error", "")
            row["result"] = "refused by design" if case.refused in said and "not support" in said else (
                "zeal ran (expected a refusal)" if "error" not in zl else "zeal failed otherwise")
            row["deepspeed"] = ds["error"] if "error" in ds else f"ran {len(ds['losses'])} steps"
            row["zeal_said"] = said
            print(f"   refused by design: {row['result']}; DeepSpeed: {row['deepspeed'][:200]}", flush=True)
        elif "error" in ds or "error" in zl:
            row["result"] = "DeepSpeed failed" if "error" in ds else "zeal failed"
        else:
            n = min(len(ds["losses"]), len(zl["losses"]))
            row["max_rel"] = max_rel(zl["losses"][:n], ds["losses"][:n]) if n else float("nan")
            row["steps"] = n
            row["time_ratio"] = zl["step_s"] / ds["step_s"]
            row["result"] = "ok" if row["max_rel"] <= case.tol else "over tolerance"
            print(f"   max rel diff {row['max_rel']:.2e} (tol {case.tol:.0e}) over {n} steps; "
                  f"step time zeal {zl['step_s'] * 1e3:.1f} ms / DeepSpeed {ds['step_s'] * 1e3:.1f} ms", flush=True)
        rows.append(row)
    print("\n| script | API used | ranks | stage | max rel loss diff | tol | step time zeal/DS | result |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        diff = f"{r['max_rel']:.1e}" if "max_rel" in r else "-"
        ratio = f"{r['time_ratio']:.2f}" if "time_ratio" in r else "-"
        print(f"| {r['case']} | {r['api']} | {r['ranks']} | {r['stage']} | {diff} | {r['tol']:.0e} | {ratio} | "
              f"{r['result']} |")
    compared = [r for r in rows if not r["result"].startswith(("refused", "zeal ran (expected"))]
    ok = sum(r["result"] == "ok" for r in compared)
    print(f"\n{ok} of {len(compared)} compared cases within tolerance; "
          f"{sum(r['result'] == 'refused by design' for r in rows)} refused by design (counted apart); "
          f"whole run {time.perf_counter() - t_start:.0f} s")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
