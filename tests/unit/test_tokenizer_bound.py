"""text.tokenizer's guards for long texts: ``min_tokens`` is a true lower bound (never refuse what
fits), ``encode(limit=)`` refuses over-long texts, and tokenizing does not hold the GIL."""

from __future__ import annotations

import json
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from modelgen.tokenizer import SPECIAL_TOKENS
from text.tokenizer import TokenLimitExceeded, Tokenizer

_TEXT = st.lists(st.one_of(st.text(st.characters(codec="utf-8"), max_size=40), st.sampled_from(SPECIAL_TOKENS),
                           st.sampled_from([" " * 30, "a" * 50, "\n\n\n", "日本語", "😀"])), max_size=12).map("".join)


@pytest.fixture(scope="module")
def tok(tiny_llama_dir) -> Tokenizer:
    return Tokenizer.from_dir(tiny_llama_dir)


@settings(max_examples=300, deadline=None)
@given(text=_TEXT)
def test_min_tokens_never_exceeds_the_count(tok, text) -> None:
    n = len(tok.encode(text, add_special_tokens=False))
    assert tok.min_tokens(text) <= n
    with pytest.raises(TokenLimitExceeded):
        tok.encode(text, limit=n)  # the bos makes it n + 1 >= n
    assert len(tok.encode(text, limit=n + 2)) == n + 1


def test_the_bound_refuses_4mb_without_tokenizing(tok) -> None:
    text = "b c " * 999999
    assert tok.min_tokens(text) * 19 >= len(text)  # the longest token here is 19 bytes
    t0 = time.monotonic()
    with pytest.raises(TokenLimitExceeded) as e:
        tok.encode(text, limit=256)
    assert not e.value.exact and e.value.tokens >= 256
    assert time.monotonic() - t0 < 0.5  # tokenizing it takes seconds; the bound, microseconds
    with pytest.raises(TokenLimitExceeded) as e:
        tok.encode("word " * 300, limit=256)  # under the bound, over the limit: counted exactly
    assert e.value.exact and e.value.tokens == len(tok.encode("word " * 300))


def _spec(tiny_llama_dir, **changes) -> str:
    spec = json.loads((tiny_llama_dir / "tokenizer.json").read_text())
    spec.update(changes)
    return json.dumps(spec)


@pytest.mark.parametrize("changes, bounded", [
    ({}, True),
    ({"normalizer": {"type": "NFC"}}, True),
    ({"normalizer": {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "_"},
                                                         {"type": "Replace", "pattern": {"String": " "},
                                                          "content": "\u2581"}]}}, True),
    ({"normalizer": {"type": "Strip", "strip_left": True, "strip_right": True}}, False),
    ({"normalizer": {"type": "StripAccents"}}, False),
    ({"normalizer": {"type": "Replace", "pattern": {"String": "  "}, "content": " "}}, False),
    ({"pre_tokenizer": {"type": "Whitespace"}}, False),
    ({"truncation": {"direction": "Right", "max_length": 8, "strategy": "LongestFirst", "stride": 0}}, False),
])
def test_no_bound_where_the_tokenizer_may_drop_input(tmp_path, tiny_llama_dir, changes, bounded) -> None:
    import shutil

    d = tmp_path / "tok"
    shutil.copytree(tiny_llama_dir, d, ignore=shutil.ignore_patterns("*.safetensors"))
    (d / "tokenizer.json").write_text(_spec(tiny_llama_dir, **changes))
    t = Tokenizer.from_dir(d)
    text = "héllo   wörld " * 40
    assert (t.min_tokens(text) > 0) is bounded
    assert t.min_tokens(text) <= len(t.encode(text))


def test_encoding_a_long_text_leaves_other_threads_running(tok) -> None:
    """Plain ``encode`` held the GIL for the whole 4 MB (8 s here, every thread stopped); the bound
    is generous for a loaded box, docs/reliability.md has the figures."""
    text = "b c " * 999999
    gaps: list[float] = []
    stop = threading.Event()

    def ticker() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            time.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    t = threading.Thread(target=ticker)
    t.start()
    try:
        ids = tok.encode(text)
    finally:
        stop.set()
        t.join()
    assert len(ids) == 2_000_000
    assert max(gaps) < 1.0, f"another thread waited {max(gaps):.2f}s for the GIL"
