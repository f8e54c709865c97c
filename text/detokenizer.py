"""Streaming text: ids → complete characters, and stop strings across chunk boundaries."""

from __future__ import annotations

import codecs
from collections.abc import Iterable, Sequence
from typing import Protocol

# A character is at most 4 UTF-8 bytes; byte-fallback tokenizers spend one id per byte.
_MAX_PENDING_IDS = 8


class StopStringError(ValueError):
    """Stop strings that are not a bounded list of non-empty strings."""


class TokenDecoder(Protocol):
    """What the detokenizer needs of a tokenizer (:class:`text.tokenizer.Tokenizer` has it)."""

    @property
    def is_byte_level(self) -> bool: ...
    def validate_ids(self, ids: Iterable[int]) -> None: ...
    def token_bytes(self, token_id: int, skip_special_tokens: bool = False) -> bytes | None: ...
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...
    def knows(self, token_id: int) -> bool: ...


class IncrementalDetokenizer:
    """Turns a stream of ids into text, emitting only complete characters.

    ``push(ids)`` returns the text the new ids complete; a character split across tokens
    is returned whole once its last byte arrives, never as U+FFFD. ``flush()`` at the end
    returns what is left (an unfinished character there becomes U+FFFD). For byte-level
    tokenizers the concatenation of all returns equals
    ``tokenizer.decode(all_ids, skip_special_tokens)`` exactly.

    Byte-level tokenizers go through an incremental UTF-8 decoder (exact, O(new bytes)).
    Others re-decode a short window of recent ids and emit the growth once it does not end
    in U+FFFD; ``context_ids`` (e.g. the prompt's last ids) give that window its left
    context so leading-space rules (SentencePiece) apply as in a full decode.
    """

    def __init__(
        self,
        tokenizer: TokenDecoder,
        *,
        skip_special_tokens: bool = True,
        context_ids: Sequence[int] = (),
    ) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._ids = list(context_ids[-_MAX_PENDING_IDS:]) if not tokenizer.is_byte_level else []
        self._prefix = 0
        self._read = len(self._ids)

    def push(self, ids: Iterable[int]) -> str:
        ids = list(ids)
        self._tok.validate_ids(ids)
        if self._tok.is_byte_level:
            raw = b"".join(self._tok.token_bytes(i, self._skip) or b"" for i in ids)
            return self._utf8.decode(raw)
        self._ids.extend(ids)
        return self._emit(final=False)

    def flush(self) -> str:
        if self._tok.is_byte_level:
            return self._utf8.decode(b"", final=True)
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        before = self._tok.decode(self._ids[self._prefix : self._read], self._skip)
        after = self._tok.decode(self._ids[self._prefix :], self._skip)
        pending = len(self._ids) - self._read
        if not final and pending < _MAX_PENDING_IDS:
            if len(after) <= len(before):
                return ""
            # A trailing U+FFFD from a known token is a character still being assembled;
            # one from an id the tokenizer lacks is final text.
            if after.endswith("\ufffd") and self._tok.knows(self._ids[-1]):
                return ""
        text = after[len(before) :] if len(after) > len(before) else ""
        self._prefix, self._read = self._read, len(self._ids)
        # Only the window is needed again; drop older ids so memory stays bounded.
        del self._ids[: self._prefix]
        self._read -= self._prefix
        self._prefix = 0
        return text


class StopMatcher:
    """Cuts a text stream at the first stop string, holding back possible partial stops.

    ``push(text) -> (emit, stopped)``: ``emit`` is text that is certainly before any stop
    (a tail that could begin a stop is held back); when a stop completes, ``emit`` ends just
    before it, ``stopped`` is True and :attr:`matched` names it. The stream stops where a
    stop string *first completes*; at one position the longest stop wins. That makes the
    result independent of how the text was chunked. ``flush()`` at the end of a stream that
    did not stop returns the held-back tail.

    The held tail is the longest suffix that is a prefix of some stop, so any occurrence
    that ends in new text starts inside ``held + text``: each push is a few ``str.find``
    calls over that window, not a loop over characters.
    """

    def __init__(self, stops: Sequence[str] = (), *, max_stops: int = 16,
                 max_stop_chars: int = 1024) -> None:
        if isinstance(stops, str) or not isinstance(stops, (list, tuple)):
            raise StopStringError("stop must be a list of strings")
        if len(stops) > max_stops:
            raise StopStringError(f"at most {max_stops} stop strings, got {len(stops)}")
        for s in stops:
            if not isinstance(s, str) or not s:
                raise StopStringError("each stop string must be a non-empty string")
            if len(s) > max_stop_chars:
                raise StopStringError(f"stop strings are at most {max_stop_chars} characters")
        self._stops = list(dict.fromkeys(stops))
        self._held = ""
        self.matched: str | None = None

    @property
    def stopped(self) -> bool:
        return self.matched is not None

    def push(self, text: str) -> tuple[str, bool]:
        if not isinstance(text, str):
            raise TypeError(f"StopMatcher.push needs a str, got {type(text).__name__}")
        if self.matched is not None:
            return "", True
        if not self._stops:
            return text, False
        window = self._held + text
        best: str | None = None
        best_end = 0
        for stop in self._stops:
            at = window.find(stop)
            if at < 0:
                continue
            end = at + len(stop)
            if best is None or end < best_end or (end == best_end and len(stop) > len(best)):
                best, best_end = stop, end
        if best is not None:
            self.matched = best
            self._held = ""
            return window[: best_end - len(best)], True
        keep = max(_partial_len(window, stop) for stop in self._stops)
        self._held = window[len(window) - keep :] if keep else ""
        return window[: len(window) - keep], False

    def flush(self) -> str:
        held, self._held = self._held, ""
        return "" if self.matched is not None else held


def _partial_len(window: str, stop: str) -> int:
    """Length of the longest suffix of ``window`` that is a proper prefix of ``stop``."""
    i = window.find(stop[0], max(0, len(window) - len(stop) + 1))
    while i >= 0:
        if stop.startswith(window[i:]):
            return len(window) - i
        i = window.find(stop[0], i + 1)
    return 0
