"""Small agreements between ranks: gather a short string from every rank, and let every
rank learn the first error any rank had, so that all of them raise together instead of
some waiting in a collective for a rank that already gave up.

These are control messages outside training: they go through the Comm like every other
collective and are counted as kind "control". At world size 1 nothing is sent.
"""

from __future__ import annotations

import torch

from zeal.dist.comm import Comm


def gather_strings(comm: Comm, s: str, width: int = 8192) -> list[str]:
    """``s`` from every rank of ``comm``, in rank order (each cut to ``width`` bytes)."""
    if not comm.active:
        return [s]
    data = s.encode()[:width]
    buf = torch.zeros(width, dtype=torch.uint8)  # (width,): the string, zero-padded
    if data:
        buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    device = comm.ctx.device  # NCCL groups take device tensors only
    out = torch.zeros(width * comm.size, dtype=torch.uint8, device=device)
    comm.all_gather(out, buf.to(device), "control")
    out = out.cpu()
    return [bytes(out[i * width:(i + 1) * width].tolist()).rstrip(b"\0").decode(errors="replace")
            for i in range(comm.size)]


def first_error(comm: Comm, err: str | None) -> str | None:
    """Every rank learns the first error any rank reported (in rank order), or None;
    a barrier as well."""
    errs = [e for e in gather_strings(comm, err or "") if e]
    return errs[0] if errs else None
