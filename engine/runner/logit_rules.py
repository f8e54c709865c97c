"""Logit rules of a step's rows: penalties, logit bias and min_tokens, on the device, batched.

The rows of requests with rules (``SamplingParams.has_logit_rules``) are adjusted in place in the
step's ``[S, V]`` float32 logits before the sampler's filters (and before greedy's argmax), in
the order and with the semantics of the usual servers:

1. ``repetition_penalty`` r: every token of the prompt or of the output so far has its logit
   divided by r when positive, multiplied by r otherwise;
2. ``frequency_penalty`` f and ``presence_penalty`` p: minus ``f * count + p * (count > 0)``,
   ``count`` the token's occurrences in the output so far;
3. ``logit_bias``: each (token, bias) pair added;
4. ``min_tokens``: the model's end-of-sequence ids (unless ``ignore_eos``) and the request's stop
   token ids at -inf while the output is shorter than it.

The state is rebuilt per step from the rows' token lists (``ScheduledSeq.history``, complete when
the runner samples: ruled rows are sampled after the step before is collected, as grammar rows
are): one flat upload of (row, token) pairs per rule and one ``index_put_`` each, never a Python
loop over tokens, and nothing kept between steps that a preemption, an abort or a reload could
leave stale. Its cost grows with the ruled rows' lengths, which only those requests pay; a row
without rules is not touched.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch


def apply_logit_rules(logits: torch.Tensor, rows: Sequence[tuple[int, Any]], eos_ids: Sequence[int]) -> None:
    """Adjust ``logits`` [S, V] float32 in place for ``rows``: (row of ``logits``, its
    ``ScheduledSeq``) of the requests with rules; ``eos_ids``: the model's end-of-sequence ids."""
    if not rows:
        return
    dev, vocab = logits.device, logits.shape[1]
    idx = [k for k, _ in rows]
    sub = logits.index_select(0, torch.tensor(idx, dtype=torch.int64).to(dev, non_blocking=True))
    params = [e.params for _, e in rows]
    outputs = [np.asarray(e.history[e.num_prompt:], dtype=np.int64) for _, e in rows]

    # 1. repetition: the tokens seen anywhere in the sequence (prompt and output)
    rep = [j for j, p in enumerate(params) if p.repetition_penalty != 1.0]
    if rep:
        seen = torch.zeros((len(rows), vocab), dtype=torch.bool, device=dev)
        r_rows, r_toks = _pairs(rep, [np.asarray(rows[j][1].history, dtype=np.int64) for j in rep])
        seen.index_put_((r_rows.to(dev), r_toks.to(dev)), torch.ones((), dtype=torch.bool, device=dev))
        r = _column([p.repetition_penalty for p in params], dev)
        sub.copy_(torch.where(seen, torch.where(sub > 0, sub / r, sub * r), sub))

    # 2. frequency and presence: the output's counts
    pen = [j for j, p in enumerate(params) if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0]
    if pen:
        counts = torch.zeros((len(rows), vocab), dtype=torch.float32, device=dev)
        c_rows, c_toks = _pairs(pen, [outputs[j] for j in pen])
        counts.index_put_((c_rows.to(dev), c_toks.to(dev)), torch.ones((), dtype=torch.float32, device=dev),
                          accumulate=True)
        freq = _column([p.frequency_penalty for p in params], dev)
        pres = _column([p.presence_penalty for p in params], dev)
        sub.sub_(counts * freq + (counts > 0).float() * pres)

    # 3. bias
    biased = [j for j, p in enumerate(params) if p.logit_bias]
    if biased:
        b_rows = np.concatenate([np.full(len(params[j].logit_bias), j, dtype=np.int64) for j in biased])
        b_toks = np.concatenate([np.fromiter((t for t, _ in params[j].logit_bias), np.int64) for j in biased])
        b_vals = np.concatenate([np.fromiter((v for _, v in params[j].logit_bias), np.float32) for j in biased])
        sub.index_put_((torch.from_numpy(b_rows).to(dev), torch.from_numpy(b_toks).to(dev)),
                       torch.from_numpy(b_vals).to(dev), accumulate=True)

    # 4. min_tokens: no end before it
    ban_rows: list[int] = []
    ban_toks: list[int] = []
    for j, p in enumerate(params):
        if p.min_tokens and len(outputs[j]) < p.min_tokens:
            ends = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_ids))
            ends = [t for t in ends if 0 <= t < vocab]
            ban_rows += [j] * len(ends)
            ban_toks += ends
    if ban_rows:
        sub.index_put_((torch.tensor(ban_rows, dtype=torch.int64).to(dev), torch.tensor(ban_toks, dtype=torch.int64).to(dev)),
                       torch.tensor(float("-inf"), device=dev))

    logits.index_copy_(0, torch.tensor(idx, dtype=torch.int64).to(dev, non_blocking=True), sub)


def _pairs(which: list[int], tokens: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token) index tensors of ``tokens[i]`` in row ``which[i]``, flat, on the host."""
    rows = np.concatenate([np.full(len(t), j, dtype=np.int64) for j, t in zip(which, tokens)])
    toks = np.concatenate(tokens) if tokens else np.zeros(0, dtype=np.int64)
    return torch.from_numpy(rows), torch.from_numpy(toks)


def _column(values: list[float], dev: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32).to(dev, non_blocking=True)[:, None]
