"""Prompt logprobs: each prompt token's logprob (and the top N at its position) from a prefill's
hidden states, for the chunks of requests that ask (``SamplingParams.prompt_logprobs``; the
completions API's ``echo`` with ``logprobs``, lm-eval's loglikelihood).

A chunk covering prompt positions ``start .. start + n - 1`` gives the logprobs of the prompt
tokens ``start + 1 .. start + n`` (the token after each position), the last chunk stopping at the
prompt's last token (its position's logits are the first sample's). The rows go through the LM
head in slices of ``ROWS_PER_SLICE`` (the slice's logits and their float32 log-softmax: 32 rows of
a 128k vocabulary hold 41 MB at once, within what a model's booked workspace adds to its
warm-up's measurement, ``engine.core.memory_plan.workspace_margin``; 256 rows held 328 MB), each
slice's chosen and top-N values reaching the host in one transfer. Such a step runs eagerly
(``ModelRunner.step_plan``): no graph computes logits at every position.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

ROWS_PER_SLICE = 32


@torch.inference_mode()
def prompt_logprobs(model: Any, hidden: torch.Tensor, seqs: list[Any]) -> dict[str, dict[int, dict]]:
    """{req_id: {prompt position of the token: {"token_id", "logprob", "top_logprobs"}}} for the
    entries of ``seqs`` (a step's ``ScheduledSeq`` list, in the order of ``hidden``'s rows) that
    ask for their prompt's logprobs in this chunk."""
    rows: list[np.ndarray] = []
    targets: list[np.ndarray] = []
    spans: list[tuple[str, int, int, int]] = []  # req_id, first position, count, top N
    off = 0
    for e in seqs:
        n = len(e.token_ids)
        want = e.params.prompt_logprobs
        if want is not None and e.history is not None and e.output_step == 0:
            last = min(e.start_pos + n, e.num_prompt - 1)  # positions start .. last - 1 predict a prompt token
            if last > e.start_pos:
                count = last - e.start_pos
                rows.append(np.arange(off, off + count, dtype=np.int64))
                targets.append(np.asarray(e.history[e.start_pos + 1:last + 1], dtype=np.int64))
                spans.append((e.req_id, e.start_pos + 1, count, want))
        off += n
    if not spans:
        return {}
    all_rows, all_targets = np.concatenate(rows), np.concatenate(targets)
    k = max(s[3] for s in spans)
    dev = hidden.device
    host = []
    for a in range(0, len(all_rows), ROWS_PER_SLICE):
        r = torch.from_numpy(all_rows[a:a + ROWS_PER_SLICE]).to(dev)
        t = torch.from_numpy(all_targets[a:a + ROWS_PER_SLICE]).to(dev)
        lp = torch.log_softmax(model.compute_logits(hidden.index_select(0, r)).float(), dim=-1)
        chosen = lp.gather(1, t[:, None])
        top_lp, top_ids = lp.topk(k, dim=-1) if k > 0 else (lp[:, :0], t[:, None][:, :0])
        host.append(torch.cat([chosen.double(), top_ids.double(), top_lp.double()], 1).cpu())
    table = torch.cat(host).tolist()
    out: dict[str, dict[int, dict]] = {}
    i = 0
    for req_id, first, count, want in spans:
        got = out.setdefault(req_id, {})
        for j in range(count):
            row = table[i + j]
            got[first + j] = {"token_id": int(all_targets[i + j]), "logprob": row[0],
                              "top_logprobs": [{"token_id": int(row[1 + m]), "logprob": row[1 + k + m]}
                                               for m in range(want)]}
        i += count
    return out
