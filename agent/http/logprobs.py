"""Engine logprobs → OpenAI's two logprobs shapes (chat and legacy completions).

The engine sends, per generated token, ``{"token_id", "logprob", "top_logprobs": [{"token_id",
"logprob"}, ...]}`` with the top entries best first (``RequestOutput.logprobs``). Only token ids cross
the IPC; the text of each token is decoded here.
"""

from __future__ import annotations

from typing import Any


def _entry(raw: Any) -> tuple[float, list[tuple[int, float]]]:
    if isinstance(raw, dict):
        tops = raw.get("top_logprobs") or []
        return float(raw["logprob"]), [(int(t["token_id"]), float(t["logprob"])) for t in tops]
    raise ValueError(f"unexpected logprobs entry {raw!r}")


def _text(tok: Any, token_id: int) -> str:
    return tok.decode([token_id])


def chat_logprobs(tok: Any, token_ids: list[int], entries: list[Any]) -> dict[str, Any]:
    content = []
    for tid, raw in zip(token_ids, entries):
        lp, top = _entry(raw)
        text = _text(tok, tid)
        content.append({
            "token": text, "logprob": lp, "bytes": list(text.encode()),
            "top_logprobs": [{"token": (t := _text(tok, i)), "logprob": v, "bytes": list(t.encode())} for i, v in top],
        })
    return {"content": content}


def completion_logprobs(tok: Any, token_ids: list[int], entries: list[Any]) -> dict[str, Any]:
    tokens, token_lps, tops, offsets = [], [], [], []
    offset = 0
    for tid, raw in zip(token_ids, entries):
        lp, top = _entry(raw)
        text = _text(tok, tid)
        tokens.append(text)
        token_lps.append(lp)
        tops.append({_text(tok, i): v for i, v in top} if top else None)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}
