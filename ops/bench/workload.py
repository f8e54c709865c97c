"""The "sharegpt-like" workload of the benchmarks (docs/perf.md) — keep this recipe exact so figures compare.

``numpy.random.default_rng(seed)``; per request: draw the input length
``int(exp(normal(5.05, 1.0)))`` then the output length ``int(exp(normal(4.90, 0.9)))``,
redrawing both until ``4 <= in <= 1024``, ``out >= 4`` and ``in + out <= 2048`` (vLLM's ShareGPT
filters); then the prompts, request after request, as ``in`` uniform token ids in
``[100, vocab - 100)``. All lengths are drawn before any prompt because numpy's bounded integer
draws consume a range-dependent amount of the stream: drawn interleaved, the tiny model's
vocabulary would give other lengths than Llama's. With seed 0 and 1000 requests the means are
215.7 in / 192.3 out (the distribution's: 214 / 197). Requests are sent with ``ignore_eos`` and
``max_tokens = out``.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

import numpy as np

NAME = "sharegpt-like"
IN_MU, IN_SIGMA = 5.05, 1.0
OUT_MU, OUT_SIGMA = 4.90, 0.9
MIN_LEN, MAX_IN, MAX_TOTAL = 4, 1024, 2048
ID_MARGIN = 100


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int

    @property
    def input_len(self) -> int:
        return len(self.prompt_token_ids)


def sharegpt_like(num_requests: int = 1000, vocab_size: int = 128256, seed: int = 0) -> list[BenchRequest]:
    """The workload's requests, deterministic for (num_requests, vocab_size, seed)."""
    if vocab_size <= 2 * ID_MARGIN:
        raise ValueError(f"vocab_size must exceed {2 * ID_MARGIN} to draw ids in [100, vocab - 100)")
    if num_requests < 0:
        raise ValueError("num_requests must be >= 0")
    rng = np.random.default_rng(seed)
    lengths: list[tuple[int, int]] = []
    for _ in range(num_requests):
        while True:
            n_in = int(np.exp(rng.normal(IN_MU, IN_SIGMA)))
            n_out = int(np.exp(rng.normal(OUT_MU, OUT_SIGMA)))
            if MIN_LEN <= n_in <= MAX_IN and n_out >= MIN_LEN and n_in + n_out <= MAX_TOTAL:
                break
        lengths.append((n_in, n_out))
    return [BenchRequest(rng.integers(ID_MARGIN, vocab_size - ID_MARGIN, size=n_in).tolist(), n_out)
            for n_in, n_out in lengths]


SHARED_SYSTEM = "shared-system"
MULTI_TURN = "multi-turn"


def shared_system(num_requests: int = 1000, vocab_size: int = 128256, seed: int = 0, group: int = 50,
                  system_len: int = 1024) -> list[BenchRequest]:
    """Issue 20's shared-system-prompt workload: consecutive groups of ``group`` requests share a
    ``system_len``-token system prompt (one per group, drawn from ``seed + 1``), followed by the
    sharegpt-like request's own prompt; its output length stays the sharegpt-like one."""
    base = sharegpt_like(num_requests, vocab_size, seed)
    rng = np.random.default_rng(seed + 1)
    systems = [rng.integers(ID_MARGIN, vocab_size - ID_MARGIN, size=system_len).tolist()
               for _ in range(-(-num_requests // group))]
    return [BenchRequest(systems[i // group] + r.prompt_token_ids, r.output_len) for i, r in enumerate(base)]


@dataclass(frozen=True)
class Conversation:
    """A chat replayed turn by turn: turn ``t``'s prompt is every earlier turn's prompt and the
    model's own answer to it, then ``user_turns[t]``; it asks for ``output_lens[t]`` tokens."""

    user_turns: list[list[int]]
    output_lens: list[int]


def multi_turn(num_conversations: int = 200, turns: int = 5, vocab_size: int = 128256, seed: int = 0,
               max_total: int = 4096) -> list[Conversation]:
    """Issue 20's chat replay: the user turns and answer lengths of sharegpt-like requests, ``turns``
    per conversation, cut so a conversation's history stays within ``max_total`` tokens."""
    reqs = sharegpt_like(num_conversations * turns, vocab_size, seed)
    out = []
    for c in range(num_conversations):
        users, lens, total = [], [], 0
        for r in reqs[c * turns:(c + 1) * turns]:
            n_in, n_out = min(r.input_len, 256), min(r.output_len, 256)  # a chat turn, not a document
            if total + n_in + n_out > max_total:
                break
            users.append(r.prompt_token_ids[:n_in])
            lens.append(n_out)
            total += n_in + n_out
        out.append(Conversation(users, lens))
    return out


def percentile(xs: list[float], q: float) -> float | None:
    """Nearest-rank percentile ``q`` (0-100) of ``xs``; None for no data. Every bench uses this one."""
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


class TokenTimes:
    """When each request was sent and when its tokens came back: TTFT and TPOT for every bench
    that drives the engine in-process (``sent`` before ``add_request``, ``observe`` each step)."""

    def __init__(self) -> None:
        self.sent: dict[str, float] = {}
        self.first: dict[str, float] = {}
        self.last: dict[str, float] = {}
        self.n_out: dict[str, int] = {}

    def observe(self, outs, now: float) -> None:
        for o in outs:
            if o.new_token_ids:
                self.first.setdefault(o.req_id, now)
                self.last[o.req_id] = now
                self.n_out[o.req_id] = self.n_out.get(o.req_id, 0) + len(o.new_token_ids)

    @property
    def output_tokens(self) -> int:
        return sum(self.n_out.values())

    def latency(self, only: set[str] | None = None) -> dict[str, float | None]:
        """TTFT (sent → first token) and TPOT (first → last token, per later token) p50 / p99, ms;
        ``only``: of those requests alone."""
        keys = [k for k in self.first if only is None or k in only]
        ttft = [(self.first[k] - self.sent[k]) * 1e3 for k in keys]
        tpot = [(self.last[k] - self.first[k]) * 1e3 / (self.n_out[k] - 1) for k in keys if self.n_out[k] > 1]
        return {"ttft_ms_p50": percentile(ttft, 50), "ttft_ms_p99": percentile(ttft, 99),
                "tpot_ms_p50": percentile(tpot, 50), "tpot_ms_p99": percentile(tpot, 99)}


def summary(reqs: list[BenchRequest]) -> dict[str, float]:
    n = max(len(reqs), 1)
    return {
        "requests": len(reqs),
        "mean_input": sum(r.input_len for r in reqs) / n,
        "mean_output": sum(r.output_len for r in reqs) / n,
        "max_total": max((r.input_len + r.output_len for r in reqs), default=0),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-requests", type=int, default=1000)
    ap.add_argument("--vocab-size", type=int, default=128256)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    print(json.dumps(summary(sharegpt_like(a.num_requests, a.vocab_size, a.seed))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
