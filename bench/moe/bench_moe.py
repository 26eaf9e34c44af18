"""MoE GPT vs the dense GPT of the same active parameters, one process on CPU.

Prints step time and tokens/s of: the dense GPT; the 8-expert top-1 MoE GPT (an MoE MLP
every other block: same active parameters per token plus the router) with the einsum
dispatch and with the sort dispatch; and the held-out loss of each after the same
tokens on the standard-library corpus (bytes as tokens) with the max/mean expert load
of the last step, with the auxiliary loss (coefficient ``--aux``) and without it.

    flock /tmp/zeal-heavy.lock python bench/moe/bench_moe.py --steps 60
"""

from __future__ import annotations

import argparse
import time

import torch


def _corpus_blocks(seq: int, vocab: int) -> torch.Tensor:
    """Byte-level blocks of the standard-library corpus (ids < 256 ≤ vocab)."""
    from zeal.data.corpus import stdlib_corpus

    data = "\n".join(stdlib_corpus(2_000_000).documents).encode("utf-8", "ignore")
    ids = torch.tensor(list(data), dtype=torch.long) % vocab
    n = ids.numel() // seq
    return ids[: n * seq].view(n, seq)


def _run(kind: str, args, blocks: torch.Tensor) -> dict:
    import zeal
    from zeal.models import GPT, GPTConfig
    from zeal.models.moe_mlp import MoEMLP

    torch.manual_seed(0)
    moe = kind.startswith("moe")
    cfg = GPTConfig(vocab_size=256, n_positions=args.seq, n_embd=args.dim, n_layer=args.layers, n_head=4,
                    num_experts=8 if moe else 0, top_k=1, capacity_factor=1.25,
                    aux_loss_coef=0.0 if kind.endswith("noaux") else args.aux)
    model = GPT(cfg)
    for m in model.modules():
        if isinstance(m, MoEMLP):
            m.moe.deepspeed_moe.dispatch = "sort" if kind == "moe-sort" else "einsum"
    engine = zeal.initialize(model, {"train_micro_batch_size_per_gpu": args.micro, "zero_optimization": {"stage": 1},
                                     "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}}})
    train, held = blocks[: -64], blocks[-64:]
    g = torch.Generator().manual_seed(1)
    times = []
    for _ in range(args.steps):
        batch = train[torch.randint(0, train.shape[0], (args.micro,), generator=g)]
        t0 = time.perf_counter()
        loss = engine(batch, batch)
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - t0)
    loads = [m.moe.deepspeed_moe.exp_counts.float() for m in model.modules() if isinstance(m, MoEMLP)]
    balance = max(float(c.max() / c.mean()) for c in loads) if loads else float("nan")
    engine.module.eval()
    with torch.no_grad():
        out = engine(held, held)
        aux = sum(float(m.l_aux) for m in model.modules() if isinstance(m, MoEMLP))
        heldout = float(out) - engine.module.config.aux_loss_coef * aux  # the LM loss alone
    engine.close()
    warm = times[min(5, len(times) - 1):]
    step_s = sorted(warm)[len(warm) // 2]
    return {"kind": kind, "params": sum(p.numel() for p in model.parameters()), "step_ms": 1000 * step_s,
            "tok_s": args.micro * args.seq / step_s, "heldout": heldout, "balance": balance}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--aux", type=float, default=0.01)
    args = ap.parse_args()
    blocks = _corpus_blocks(args.seq, 256)
    rows = [_run(kind, args, blocks) for kind in ("dense", "moe-einsum", "moe-sort", "moe-noaux")]
    dense = rows[0]
    print(f"{'model':<11} {'params':>9} {'step ms':>8} {'tok/s':>8} {'x dense':>8} {'held-out':>9} {'max/mean':>8}")
    for r in rows:
        print(f"{r['kind']:<11} {r['params']:>9,} {r['step_ms']:>8.1f} {r['tok_s']:>8.0f} "
              f"{dense['step_ms'] / r['step_ms']:>8.2f} {r['heldout']:>9.4f} {r['balance']:>8.2f}")


if __name__ == "__main__":
    main()
