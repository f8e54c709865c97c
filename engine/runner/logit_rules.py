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
are): every rule's (row, token) pairs in one flat upload (two copies a step in all, from
page-locked memory) and one ``index_put_`` per rule, never a Python loop over tokens, and nothing kept between steps that a preemption, an abort or a reload could
leave stale. Its cost grows with the ruled rows' lengths, which only those requests pay; a row
without rules is not touched.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from engine.runner.step_buffers import to_device_async


def apply_logit_rules(logits: torch.Tensor, rows: Sequence[tuple[int, Any]], eos_ids: Sequence[int]) -> None:
    """Adjust ``logits`` [S, V] float32 in place for ``rows``: (row of ``logits``, its
    ``ScheduledSeq``) of the requests with rules; ``eos_ids``: the model's end-of-sequence ids.

    Every index and value is built on the host first and goes up in two copies (one int64, one
    float32) from page-locked memory. A copy from pageable memory waits for the stream first
    (CUDA's rule for pageable host-to-device copies): called while the step's forward pass runs,
    each of the up to nine such copies here held the host until the forward ended, so the next
    step was no longer prepared beside it. With them, 10 % of the requests carrying penalties cost
    16 % of the requests a second at concurrency 200 (H100, docs/perf.md, 1238827)."""
    if not rows:
        return
    dev, vocab = logits.device, logits.shape[1]
    params = [e.params for _, e in rows]
    n = len(rows)
    ints: list[np.ndarray] = [np.fromiter((k for k, _ in rows), np.int64, n)]
    floats: list[np.ndarray] = []

    def put(arrays: list[np.ndarray], a: np.ndarray) -> slice:
        at = sum(x.size for x in arrays)
        arrays.append(a)
        return slice(at, at + a.size)

    # 1. repetition: the tokens seen anywhere in the sequence (prompt and output)
    rep = [j for j, p in enumerate(params) if p.repetition_penalty != 1.0]
    if rep:
        r_rows, r_toks = _pairs(rep, [np.asarray(rows[j][1].history, dtype=np.int64) for j in rep])
        rep_at = (put(ints, r_rows), put(ints, r_toks), put(floats, _column([p.repetition_penalty for p in params])))
    # 2. frequency and presence: the output's counts
    pen = [j for j, p in enumerate(params) if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0]
    if pen:
        c_rows, c_toks = _pairs(pen, [np.asarray(rows[j][1].history[rows[j][1].num_prompt:], dtype=np.int64) for j in pen])
        pen_at = (put(ints, c_rows), put(ints, c_toks), put(floats, _column([p.frequency_penalty for p in params])),
                  put(floats, _column([p.presence_penalty for p in params])))
    # 3. bias
    biased = [j for j, p in enumerate(params) if p.logit_bias]
    if biased:
        bias_at = (put(ints, np.concatenate([np.full(len(params[j].logit_bias), j, dtype=np.int64) for j in biased])),
                   put(ints, np.concatenate([np.fromiter((t for t, _ in params[j].logit_bias), np.int64) for j in biased])),
                   put(floats, np.concatenate([np.fromiter((v for _, v in params[j].logit_bias), np.float32)
                                               for j in biased])))
    # 4. min_tokens: no end before it
    ban_rows: list[int] = []
    ban_toks: list[int] = []
    for j, (_, e) in enumerate(rows):
        p = params[j]
        if p.min_tokens and len(e.history) - e.num_prompt < p.min_tokens:
            ends = [t for t in set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_ids)) if 0 <= t < vocab]
            ban_rows += [j] * len(ends)
            ban_toks += ends
    if ban_rows:
        ban_at = (put(ints, np.asarray(ban_rows, dtype=np.int64)), put(ints, np.asarray(ban_toks, dtype=np.int64)))

    i_dev = to_device_async(np.concatenate(ints), dev)
    f_dev = to_device_async(np.concatenate(floats), dev) if floats else None
    idx = i_dev[:n]
    sub = logits.index_select(0, idx)
    if rep:
        seen = torch.zeros((n, vocab), dtype=torch.bool, device=dev)
        seen.index_put_((i_dev[rep_at[0]], i_dev[rep_at[1]]), torch.ones((), dtype=torch.bool, device=dev))
        r = f_dev[rep_at[2]][:, None]
        sub.copy_(torch.where(seen, torch.where(sub > 0, sub / r, sub * r), sub))
    if pen:
        counts = torch.zeros((n, vocab), dtype=torch.float32, device=dev)
        counts.index_put_((i_dev[pen_at[0]], i_dev[pen_at[1]]), torch.ones((), dtype=torch.float32, device=dev),
                          accumulate=True)
        freq, pres = f_dev[pen_at[2]][:, None], f_dev[pen_at[3]][:, None]
        sub.sub_(counts * freq + (counts > 0).float() * pres)
    if biased:
        sub.index_put_((i_dev[bias_at[0]], i_dev[bias_at[1]]), f_dev[bias_at[2]], accumulate=True)
    if ban_rows:
        sub.index_put_((i_dev[ban_at[0]], i_dev[ban_at[1]]), torch.full((), float("-inf"), device=dev))
    logits.index_copy_(0, idx, sub)


def _pairs(which: list[int], tokens: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(row, token) index arrays of ``tokens[i]`` in row ``which[i]``, flat."""
    rows = np.concatenate([np.full(len(t), j, dtype=np.int64) for j, t in zip(which, tokens)])
    toks = np.concatenate(tokens) if tokens else np.zeros(0, dtype=np.int64)
    return rows, toks


def _column(values: list[float]) -> np.ndarray:
    return np.asarray(values, dtype=np.float32)

