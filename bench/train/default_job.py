"""The default `zeal train` job over several training seeds: wall time, held-out loss, peak
memory beside `zeal estimate`, and whether its sample parses as Python (docs/default_job.md).

    python bench/train/default_job.py                          # seeds 1234 (the default), 1, 2, 3
    python bench/train/default_job.py --report-only --out DIR  # judge runs already in DIR

Each seed runs `zeal train --run-dir OUT/seedN [--seed N]`, one at a time (take the shared
CPU lock around it on a shared machine). A sample is judged with ``ast.parse`` on
*line-complete prefixes*: the prompt plus the sample cut right after a newline (an unfinished
last line dropped); a last non-blank line that opens a block (ends with ``:``) gets an
indented ``pass``, so a header the sample had no room to fill is not an error.
``first line``: the prefix ending with the first line the model wrote (blank lines skipped);
``whole``: the longest line-complete prefix.
"""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
import time
from pathlib import Path


def _parses(prefix: str) -> bool:
    lines = [ln for ln in prefix.split("\n") if ln.strip()]
    if not lines:
        return False
    last = lines[-1]
    if last.split("#", 1)[0].rstrip().endswith(":"):
        prefix = prefix.rstrip("\n") + "\n" + " " * (len(last) - len(last.lstrip()) + 4) + "pass\n"
    try:
        ast.parse(prefix)
    except (SyntaxError, ValueError):
        return False
    return True


def first_line_parses(text: str, prompt: str) -> bool:
    """The prefix ending with the first line the model wrote parses."""
    i = len(prompt)
    while i < len(text) and text[i].isspace():
        i += 1
    cut = text.find("\n", i)
    return cut >= 0 and _parses(text[: cut + 1])


def whole_parses(text: str, prompt: str) -> bool:
    """The longest line-complete prefix parses."""
    cut = text.rfind("\n")
    return cut >= len(prompt) and _parses(text[: cut + 1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="1234,1,2,3", help="training seeds (1234 runs without --seed: the default)")
    ap.add_argument("--out", default="runs/default-seeds", help="folder of the run folders")
    ap.add_argument("--report-only", action="store_true", help="judge the runs already in --out")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per run")
    args, extra = ap.parse_known_args()
    out = Path(args.out)
    walls: dict[str, float] = {}
    for seed in args.seeds.split(","):
        if args.report_only:
            break
        cmd = [sys.executable, "-m", "zeal.cli.main", "train", "--run-dir", str(out / f"seed{seed}"), *extra]
        cmd += [] if seed == "1234" else ["--seed", seed]
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, timeout=args.timeout)
        walls[seed] = time.perf_counter() - t0
    print(f"{'seed':>6}{'wall s':>8}{'train s':>9}{'held-out before -> after':>26}{'peak MiB/rank':>18}"
          f"{'first line':>12}{'whole':>7}")
    shares = [0, 0]
    runs = 0
    for seed in args.seeds.split(","):
        run = out / f"seed{seed}"
        if not (run / "summary.json").is_file():
            continue
        s = json.loads((run / "summary.json").read_text())
        prompt = json.loads((run / "config.json").read_text())["job"]["sample_prompt"]
        ok = (first_line_parses(s["sample"], prompt), whole_parses(s["sample"], prompt))
        shares = [a + b for a, b in zip(shares, ok)]
        runs += 1
        peak = "/".join(f"{b / 2**20:.0f}" for b in s["peak_rss_bytes_per_rank"])
        wall = f"{walls[seed]:.1f}" if seed in walls else "-"
        print(f"{seed:>6}{wall:>8}{s['train_time_s']:>9.1f}"
              f"{s['heldout_loss_before']:>14.3f} -> {s['heldout_loss_after']:<8.3f}{peak:>18}"
              f"{'yes' if ok[0] else 'no':>12}{'yes' if ok[1] else 'no':>7}")
    print(f"sample parses: first line {shares[0]}/{runs}, whole {shares[1]}/{runs}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
