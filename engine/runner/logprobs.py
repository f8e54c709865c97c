"""Logprobs of a step's sampled rows, read from its logits in one device-to-host transfer."""

from __future__ import annotations

import torch

from engine.runner.step import StepResult


@torch.inference_mode()
def logprobs_result(logits: torch.Tensor, ids: torch.Tensor, want: list[int | None]) -> StepResult:
    """Logprobs of the raw model distribution (before temperature and filters)."""
    lp = torch.log_softmax(logits, dim=-1)
    k = max(n or 0 for n in want)
    chosen = lp.gather(1, ids[:, None])[:, 0]
    top_lp, top_ids = lp.topk(k, dim=-1) if k > 0 else (lp[:, :0], ids[:, None][:, :0])
    # One transfer for everything the host needs from this step.
    host = torch.cat([ids[:, None].to(torch.float64), chosen[:, None].double(), top_ids.double(), top_lp.double()], 1).cpu()
    token_ids: list[int] = []
    out: list[dict | None] = []
    for r, n in enumerate(want):
        row = host[r].tolist()
        tid = int(row[0])
        token_ids.append(tid)
        if n is None:
            out.append(None)
            continue
        tops = [{"token_id": int(row[2 + j]), "logprob": row[2 + k + j]} for j in range(n)]
        out.append({"token_id": tid, "logprob": row[1], "top_logprobs": tops})
    return StepResult(token_ids, out)
