"""Engine logprobs → OpenAI's two logprobs shapes (chat and legacy completions).

The engine sends, per generated token, ``{"token_id", "logprob", "top_logprobs": [{"token_id",
"logprob"}, ...]}`` with the top entries best first (``RequestOutput.logprobs``). Only token ids cross
the IPC; the text of each token is decoded here.

How a token shows on its own (:func:`token_view`), as vLLM shows it: its text when its bytes are
valid UTF-8 by themselves; else ``"bytes:"`` and its bytes as ``\\xNN`` escapes (``"bytes:\\xe2\\x80"``:
a token holding the first two bytes of a three-byte character), so no two byte tokens read as the
same U+FFFD. An id the tokenizer does not know (a vocabulary padded past the tokenizer's) shows as
``"token_id:N"``, vLLM's form for ids, with no bytes. Chat ``bytes`` are the token's own bytes.

Legacy completions are keyed by those strings (``top_logprobs`` is a dict): should two ids still
show alike (an added token spelled like a vocabulary one), the later one is keyed ``"token_id:N"``,
so every alternative is returned. Their ``tokens`` are the text each sampled token added to the
answer (the pieces the detokenizer emitted: ``""`` for a byte that only starts a character, the
whole character for the one completing it), so ``"".join(tokens) == text`` and ``text_offset``
counts characters of ``text``, as OpenAI's does.
"""

from __future__ import annotations

import re
from typing import Any

from text.tokenizer import Tokenizer

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece byte fallback tokens


def _entry(raw: Any) -> tuple[float | None, list[tuple[int, float]] | None]:
    """(logprob, top alternatives) of an engine entry; None for a prompt's first token, which
    has none (echo)."""
    if raw is None:
        return None, None
    if isinstance(raw, dict):
        tops = raw.get("top_logprobs") or []
        return float(raw["logprob"]), [(int(t["token_id"]), float(t["logprob"])) for t in tops]
    raise ValueError(f"unexpected logprobs entry {raw!r}")


def token_view(tok: Tokenizer, token_id: int) -> tuple[str, bytes | None]:
    """(how ``token_id`` shows on its own, the bytes it stands for; None when unknown)."""
    if not tok.knows(token_id):
        return f"token_id:{token_id}", None
    raw = tok.token_bytes(token_id)
    if raw is None:  # not byte-level: a byte-fallback piece, or text
        m = _BYTE_PIECE.fullmatch(tok.token_name(token_id) or "")
        if m is None:
            text = tok.decode([token_id])
            return text, text.encode("utf-8", "surrogatepass")
        raw = bytes([int(m.group(1), 16)])
    try:
        return raw.decode("utf-8"), raw
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), raw


def chat_logprobs(tok: Tokenizer, token_ids: list[int], entries: list[Any]) -> dict[str, Any]:
    def one(token_id: int, logprob: float) -> dict[str, Any]:
        text, raw = token_view(tok, token_id)
        return {"token": text, "logprob": logprob, "bytes": None if raw is None else list(raw)}

    content = []
    for tid, raw in zip(token_ids, entries):
        lp, top = _entry(raw)
        content.append({**one(tid, lp), "top_logprobs": [one(i, v) for i, v in top]})
    return {"content": content}


def completion_logprobs(tok: Tokenizer, token_ids: list[int], pieces: list[str], entries: list[Any],
                        text: str | None = None) -> dict[str, Any]:
    """``pieces``: the text each token added; ``text``: the answer, when it may end before the
    tokens do (a stop string cut it): the tokens past its end are left out."""
    tokens, token_lps, tops, offsets = [], [], [], []
    offset = 0
    for tid, piece, raw in zip(token_ids, pieces, entries):
        lp, top = _entry(raw)
        cut = text is not None and offset + len(piece) > len(text)
        if cut:
            piece = piece[: max(0, len(text) - offset)]
        tokens.append(piece)
        token_lps.append(lp)
        alternatives: dict[str, float] = {}
        for i, v in top or ():
            key = token_view(tok, i)[0]
            alternatives[f"token_id:{i}" if key in alternatives else key] = v
        tops.append(alternatives or None)
        offsets.append(offset)
        offset += len(piece)
        if cut:
            break
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def vllm_prompt_logprobs(tok: Tokenizer, entries: list[Any]) -> list[dict[str, Any] | None]:
    """vLLM's ``prompt_logprobs`` field: per prompt token (None for the first) a map from token id
    to ``{"logprob", "decoded_token"}`` holding the prompt's own token and the top alternatives."""
    out: list[dict[str, Any] | None] = []
    for raw in entries:
        if raw is None:
            out.append(None)
            continue
        lp, top = _entry(raw)
        own = int(raw["token_id"])
        got = {str(own): {"logprob": lp, "decoded_token": token_view(tok, own)[0]}}
        for i, v in top or ():
            got.setdefault(str(i), {"logprob": v, "decoded_token": token_view(tok, i)[0]})
        out.append(got)
    return out
