"""text.tokenizer: encode/decode, incremental detokenization, stop strings."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from text.detokenizer import IncrementalDetokenizer, StopMatcher, StopStringError
from text.tokenizer import REPLACEMENT, Tokenizer, TokenizerError

# Code points from several scripts, emoji (4-byte UTF-8) and modifiers, controls.
_ALPHABET = st.characters(
    codec="utf-8",
    categories=("L", "M", "N", "P", "S", "Z", "Cc"),
)
_TEXT = st.text(alphabet=_ALPHABET, max_size=80)


@pytest.fixture(scope="module")
def tok(tiny_llama_dir) -> Tokenizer:
    return Tokenizer.from_dir(tiny_llama_dir)


@pytest.fixture(scope="module")
def hf_tok(tiny_llama_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(tiny_llama_dir)


def _random_text(rng: random.Random, n: int) -> str:
    pools = ["abc xyz ", "éüñçœß", "日本語中文한국", "😀🎉👍🏽🇫🇷", "\n\t .,!?", "Привет"]
    return "".join(rng.choice(rng.choice(pools)) for _ in range(n))


def _chunks(seq, rng: random.Random):
    i = 0
    while i < len(seq):
        n = rng.randint(1, 4)
        yield seq[i : i + n]
        i += n


# -- basics --------------------------------------------------------------------------------


def test_special_ids_and_sizes(tok):
    assert tok.vocab_size == 512
    assert tok.bos_token_id == tok.encode("x")[0]
    eot = tok.encode("<|eot_id|>", add_special_tokens=False)
    eos = tok.encode("<|end_of_text|>", add_special_tokens=False)
    assert len(eot) == 1 and len(eos) == 1
    assert set(tok.eos_token_ids) == {eot[0], eos[0]}
    assert tok.is_byte_level and tok.is_special(eot[0]) and not tok.is_special(100)


def test_every_byte_is_a_token(tok):
    assert [tok.token_bytes(i) for i in range(256)] == [bytes([b]) for b in range(256)]
    assert tok.token_bytes(128000) == REPLACEMENT.encode()


@settings(max_examples=150, deadline=None)
@given(text=_TEXT)
def test_round_trip_random_utf8(tok, text):
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id
    if "<|" not in text:  # special-token text (e.g. "<|eot_id|>") encodes as the special id
        assert tok.decode(ids, skip_special_tokens=True) == text


def test_encode_decode_match_transformers(tok, hf_tok):
    rng = random.Random(1)
    for _ in range(100):
        text = _random_text(rng, rng.randint(0, 40))
        for special in (True, False):
            assert tok.encode(text, special) == hf_tok.encode(text, add_special_tokens=special)
    for _ in range(300):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 12))]
        for skip in (True, False):
            assert tok.decode(ids, skip) == hf_tok.decode(ids, skip_special_tokens=skip)


def test_ids_past_the_tokenizer_decode_to_replacement(tok):
    hi = tok.encode("hi", add_special_tokens=False)
    assert tok.decode([*hi, 128000, 600, *hi]) == f"hi{REPLACEMENT}{REPLACEMENT}hi"
    det = IncrementalDetokenizer(tok)
    assert det.push([127999]) == REPLACEMENT


@pytest.mark.parametrize("bad", [[-1], [1.5], [True], ["3"]])
def test_bad_ids_are_refused(tok, bad):
    with pytest.raises(TokenizerError):
        tok.decode(bad)
    with pytest.raises(TokenizerError):
        IncrementalDetokenizer(tok).push(bad)


def test_encode_needs_str(tok):
    with pytest.raises(TokenizerError):
        tok.encode(b"bytes")  # type: ignore[arg-type]


def test_from_dir_errors(tmp_path, tiny_llama_dir):
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="cannot read"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text(json.dumps({"model": {"type": "Nope"}}))
    with pytest.raises(TokenizerError, match="not a valid tokenizer"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_bytes((tiny_llama_dir / "tokenizer.json").read_bytes())
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [-4]}))
    with pytest.raises(TokenizerError, match="eos_token_id"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "generation_config.json").write_text("[1, 2]")
    with pytest.raises(TokenizerError, match="JSON object"):
        Tokenizer.from_dir(tmp_path)


# -- incremental detokenization -----------------------------------------------------------


def test_split_characters_never_emit_replacement(tok):
    text = "日本語 😀👍🏽 café 🇫🇷 Привет"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > len(text)  # multi-byte characters really are split across ids
    det = IncrementalDetokenizer(tok)
    pieces = [det.push([i]) for i in ids]
    assert all(REPLACEMENT not in p for p in pieces)
    assert "".join(pieces) + det.flush() == text
    # The emoji's first ids give nothing until its last byte arrives.
    emoji = tok.encode("😀", add_special_tokens=False)
    det = IncrementalDetokenizer(tok)
    assert [det.push([i]) for i in emoji] == [""] * (len(emoji) - 1) + ["😀"]


def test_incremental_equals_full_decode_on_random_ids(tok):
    rng = random.Random(7)
    for _ in range(300):
        ids = [rng.randrange(tok.vocab_size + 20) for _ in range(rng.randint(0, 30))]
        for skip in (True, False):
            det = IncrementalDetokenizer(tok, skip_special_tokens=skip)
            out = "".join(det.push(c) for c in _chunks(ids, rng)) + det.flush()
            assert out == tok.decode(ids, skip_special_tokens=skip)


def test_dangling_partial_character_flushes_as_replacement(tok):
    ids = tok.encode("日", add_special_tokens=False)
    det = IncrementalDetokenizer(tok)
    assert det.push(ids[:-1]) == ""
    assert det.flush() == REPLACEMENT


@pytest.fixture(scope="module")
def sentencepiece_dir(tmp_path_factory):
    """A non-byte-level tokenizer (SentencePiece style, byte fallback) for the generic path."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in ["▁", "a", "b", "c", "é", "▁a", "▁b", "ab", "▁ab", "x", "y"]:
        vocab[piece] = len(vocab)
    backend = Backend(models.BPE(vocab, [("▁", "a"), ("▁", "b"), ("a", "b"), ("▁a", "b")],
                                 unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
         decoders.Strip(" ", 1, 0)]
    )
    d = tmp_path_factory.mktemp("sp")
    backend.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "bos_token": "<s>"}))
    return d


def test_generic_path_streams_like_full_decode(sentencepiece_dir):
    tok = Tokenizer.from_dir(sentencepiece_dir)
    assert not tok.is_byte_level and tok.eos_token_ids == (2,)
    text = "ab é 日本 😀 xab by"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    det = IncrementalDetokenizer(tok)
    pieces = [det.push([i]) for i in ids]
    assert all(REPLACEMENT not in p for p in pieces)
    assert "".join(pieces) + det.flush() == text
    det = IncrementalDetokenizer(tok)
    assert det.push([ids[0], 5000]) + det.flush() == "ab" + REPLACEMENT


# -- stop strings -------------------------------------------------------------------------


def _reference_stop(text: str, stops: list[str]) -> tuple[str, str | None]:
    """Cut at the first position where some stop completes (longest stop on ties)."""
    for end in range(1, len(text) + 1):
        done = [s for s in stops if text[:end].endswith(s)]
        if done:
            best = max(done, key=len)
            return text[: end - len(best)], best
    return text, None


def _run_stop(text: str, stops: list[str], rng: random.Random) -> tuple[str, str | None]:
    m = StopMatcher(stops)
    out = []
    for chunk in _chunks(text, rng):
        emit, stopped = m.push(chunk)
        out.append(emit)
        if stopped:
            return "".join(out), m.matched
    return "".join(out) + m.flush(), m.matched


def test_stop_string_split_across_pushes():
    m = StopMatcher(["Hello"])
    assert m.push("abc Hel") == ("abc ", False)  # "Hel" could begin the stop: held back
    assert m.push("l") == ("", False)
    assert m.push("p me") == ("Hellp me", False)
    assert m.push(" Hell") == (" ", False)
    assert m.push("o world") == ("", True)
    assert m.matched == "Hello" and m.push("more") == ("", True) and m.flush() == ""


def test_stop_held_tail_is_flushed_at_end():
    m = StopMatcher(["</s>"])
    assert m.push("done </") == ("done ", False)
    assert m.flush() == "</"


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="abc😀", max_size=40),
    stops=st.lists(st.text(alphabet="abc😀", min_size=1, max_size=5), max_size=3),
    seed=st.integers(0, 2**16),
)
def test_stop_matcher_is_chunking_independent(text, stops, seed):
    got = _run_stop(text, stops, random.Random(seed))
    assert got == _reference_stop(text, stops)


def test_stops_across_detokenized_tokens(tok):
    text = "The answer is 42.<|stop|> and then more"
    ids = tok.encode(text, add_special_tokens=False)
    det, m = IncrementalDetokenizer(tok), StopMatcher(["<|stop|>", "never"])
    out = []
    for i in ids:
        emit, stopped = m.push(det.push([i]))
        out.append(emit)
        if stopped:
            break
    assert "".join(out) == "The answer is 42." and m.matched == "<|stop|>"


@pytest.mark.parametrize(
    "stops", ["stop", [""], [3], ["x"] * 17, ["y" * 1025], None]
)
def test_bad_stops_are_refused(stops):
    with pytest.raises(StopStringError):
        StopMatcher(stops)
