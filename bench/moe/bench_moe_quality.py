"""Quality of an 8-expert top-2 MoE GPT against the dense GPT of the same active
parameters, after the same tokens, one process on CPU.

Models (zeal's GPT, byte vocabulary 256): the dense GPT (MLP width 4·d); the MoE GPT whose
MLP in every ``--moe-every``-th block (default: every block) is 8 experts of width 2·d routed
top-2 (so a token meets 2 · 2·d = 4·d MLP units, the dense width: the same active parameters
per token plus the router), trained with the auxiliary load-balancing loss (coefficient
``--aux``) and without it. Same initial seed, the same batches of the standard-library
corpus (zeal.data.corpus, bytes as tokens), AdamW with linear warm-up and cosine decay to a
tenth (``--schedule constant`` for a flat lr); then the held-out LM loss (aux loss
excluded, eval routing: every token to its top-2 experts) on the corpus tail, and the
expert load on that held-out pass: max/mean tokens per expert (1.0 = balanced, 8.0 = one
expert takes everything; mean over MoE layers and the worst layer).

    flock /tmp/zeal-heavy.lock python bench/moe/bench_moe_quality.py          # 1800 steps per model
    python bench/moe/bench_moe_quality.py --kinds moe-aux --log-every 100      # one model, its curve
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

HELD_OUT_BLOCKS = 64


def corpus_blocks(seq: int) -> torch.Tensor:
    """Byte-level blocks of the standard-library corpus."""
    from zeal.data.corpus import stdlib_corpus

    data = "\n".join(stdlib_corpus(4_000_000).documents).encode("utf-8", "ignore")
    ids = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    n = ids.numel() // seq
    return ids[: n * seq].view(n, seq)


def build(kind: str, args) -> nn.Module:
    """The dense GPT, or the MoE GPT with experts of half the dense MLP width."""
    from zeal.models import GPT, GPTConfig
    from zeal.models.gpt import MLP
    from zeal.models.moe_mlp import MoEMLP

    torch.manual_seed(args.seed)
    moe = kind != "dense"
    cfg = GPTConfig(vocab_size=256, n_positions=args.seq, n_embd=args.dim, n_layer=args.layers, n_head=4,
                    num_experts=8 if moe else 0, moe_every=args.moe_every, top_k=2,
                    capacity_factor=args.capacity_factor,
                    aux_loss_coef=args.aux if kind == "moe-aux" else 0.0, drop_tokens=not args.dropless)
    model = GPT(cfg)
    for m in model.modules():
        if isinstance(m, MoEMLP):
            for g, e in m.moe.deepspeed_moe.experts.deepspeed_experts.items():
                assert isinstance(e, MLP)
                gen_seed = args.seed * 1000 + int(g)  # experts start different, the same in every MoE run
                torch.manual_seed(gen_seed)
                e.c_fc = nn.Linear(args.dim, 2 * args.dim)
                e.c_proj = nn.Linear(2 * args.dim, args.dim)
                for lin in (e.c_fc, e.c_proj):
                    model._init_weights(lin)
                for p in e.parameters():  # the expert markers (zeal.moe.layer.Experts sets them)
                    p.allreduce, p.group_name = False, "ep_size_1"
    return model


def active_params(model: nn.Module, top_k: int) -> int:
    """Parameters a token meets: all but the experts, plus top_k experts per MoE layer."""
    from zeal.models.moe_mlp import MoEMLP

    total = sum(p.numel() for p in model.parameters())
    for m in model.modules():
        if isinstance(m, MoEMLP):
            experts = list(m.moe.deepspeed_moe.experts.deepspeed_experts.values())
            per = sum(p.numel() for p in experts[0].parameters())
            total -= (len(experts) - top_k) * per
    return total


def run(kind: str, args, blocks: torch.Tensor) -> dict:
    import zeal
    from zeal.models.moe_mlp import MoEMLP

    model = build(kind, args)
    n_params, n_active = sum(p.numel() for p in model.parameters()), active_params(model, 2)
    config = {"train_micro_batch_size_per_gpu": args.micro, "zero_optimization": {"stage": 1},
              "optimizer": {"type": "AdamW", "params": {"lr": args.lr}}}
    if args.schedule == "cosine":  # warm-up, then cosine decay to a tenth of the peak
        config["scheduler"] = {"type": "WarmupCosineLR", "params": {
            "total_num_steps": args.steps, "warmup_num_steps": args.warmup, "warmup_type": "linear",
            "cos_min_ratio": 0.1}}
    engine = zeal.initialize(model, config)
    train, held = blocks[:-HELD_OUT_BLOCKS], blocks[-HELD_OUT_BLOCKS:]
    g = torch.Generator().manual_seed(args.seed + 1)  # the same batches for every model
    t0 = time.perf_counter()
    for step in range(args.steps):
        batch = train[torch.randint(0, train.shape[0], (args.micro,), generator=g)]
        loss = engine(batch, batch)
        engine.backward(loss)
        engine.step()
        if args.log_every and step % args.log_every == 0:
            print(f"  {kind} step {step}: training loss {float(loss):.4f} (aux term included)", flush=True)
    train_s = time.perf_counter() - t0
    engine.module.eval()
    moes = [m for m in engine.module.modules() if isinstance(m, MoEMLP)]
    losses, counts = [], [torch.zeros(8) for _ in moes]
    with torch.no_grad():
        for i in range(0, held.shape[0], args.micro):
            x = held[i:i + args.micro]
            out = engine(x, x)
            aux = sum(float(m.l_aux) for m in moes)
            losses.append(float(out) - engine.module.config.aux_loss_coef * aux)  # the LM loss alone
            for c, m in zip(counts, moes):
                c += m.moe.deepspeed_moe.exp_counts.float()
    engine.close()
    balance = [float(c.max() / c.mean()) for c in counts]
    return {"kind": kind, "params": n_params, "active": n_active, "train_s": train_s,
            "heldout": sum(losses) / len(losses), "balance": balance}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1800)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--schedule", choices=("constant", "cosine"), default="cosine",
                    help="constant lr, or linear warm-up and cosine decay to lr/10 (WarmupCosineLR)")
    ap.add_argument("--warmup", type=int, default=100, help="warm-up steps of the cosine schedule")
    ap.add_argument("--aux", type=float, default=0.01)
    ap.add_argument("--capacity-factor", type=float, default=2.0)
    ap.add_argument("--dropless", action="store_true", help="train without capacity dropping and routing noise "
                    "(as evaluation and serving route)")
    ap.add_argument("--moe-every", type=int, default=1, help="an MoE MLP every N blocks (2: every other)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=0, help="print the training loss every N steps (0: never)")
    ap.add_argument("--kinds", default="dense,moe-aux,moe-noaux")
    args = ap.parse_args()
    blocks = corpus_blocks(args.seq)
    tokens = args.steps * args.micro * args.seq
    print(f"{args.steps} steps x {args.micro} x {args.seq} = {tokens:,} training tokens; held-out "
          f"{HELD_OUT_BLOCKS * args.seq:,} tokens; d={args.dim}, {args.layers} blocks, MoE every {args.moe_every}, "
          f"capacity factor {args.capacity_factor}, aux coef {args.aux}, lr {args.lr} {args.schedule}"
          f"{f' (warm-up {args.warmup})' if args.schedule == 'cosine' else ''}", flush=True)
    print(f"{'model':<10} {'params':>10} {'active':>10} {'train s':>8} {'held-out':>9} {'vs dense':>9} "
          f"{'max/mean (mean, worst layer)':>30}", flush=True)
    dense = None
    for kind in args.kinds.split(","):
        r = run(kind, args, blocks)
        dense = r["heldout"] if kind == "dense" else dense
        bal = (f"{sum(r['balance']) / len(r['balance']):.2f}, {max(r['balance']):.2f}" if r["balance"] else "-")
        rel = f"{r['heldout'] - dense:+.4f}" if dense is not None else "-"
        print(f"{kind:<10} {r['params']:>10,} {r['active']:>10,} {r['train_s']:>8.1f} {r['heldout']:>9.4f} "
              f"{rel:>9} {bal:>30}", flush=True)


if __name__ == "__main__":
    main()
