"""engine.tokenizer: encode/decode, incremental detokenization, stop strings, chat templates."""

from __future__ import annotations

import json
import random
import sys
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.tokenizer import (
    REPLACEMENT,
    ChatTemplateError,
    ChatTemplateLimits,
    IncrementalDetokenizer,
    StopMatcher,
    StopStringError,
    Tokenizer,
    TokenizerError,
)
from engine.tokenizer_chat import ChatTemplate

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


# -- chat templates -----------------------------------------------------------------------

_CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [
        {"role": "system", "content": "  Be brief.  "},
        {"role": "user", "content": "Où est la gare? 日本 😀"},
        {"role": "assistant", "content": "À droite."},
        {"role": "user", "content": "Merci\n"},
    ],
    [{"role": "user", "content": [{"type": "text", "text": "part one, "},
                                  {"type": "text", "text": "part two"}]}],
    [{"role": "user", "content": "call it"}, {"role": "assistant", "content": None}],
]


@pytest.mark.parametrize("gen", [True, False])
@pytest.mark.parametrize("messages", _CONVERSATIONS)
def test_chat_template_matches_transformers(tok, hf_tok, messages, gen):
    ours = tok.apply_chat_template(messages, add_generation_prompt=gen)
    theirs = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
    assert ours == theirs
    assert tok.encode(ours, add_special_tokens=False) == hf_tok.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=gen, return_dict=False
    )


def test_chat_template_prefers_jinja_file_and_named_templates(tmp_path, tiny_llama_dir):
    for name in ("tokenizer.json", "generation_config.json"):
        (tmp_path / name).write_bytes((tiny_llama_dir / name).read_bytes())
    config = json.loads((tiny_llama_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "tool_use", "template": "T"},
                               {"name": "default", "template": "{{ messages|length }}"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert Tokenizer.from_dir(tmp_path).apply_chat_template([{"role": "u", "content": ""}]) == "1"
    (tmp_path / "chat_template.jinja").write_text("{{ bos_token }}{{ tools|tojson }}")
    out = Tokenizer.from_dir(tmp_path).apply_chat_template(_CONVERSATIONS[0], tools=[{"n": "<é>"}])
    assert out == '<|begin_of_text|>[{"n": "<é>"}]'


_LIMITS = ChatTemplateLimits(max_output_chars=100_000, max_steps=200_000, timeout_s=0.5)

_HOSTILE = [
    "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}",
    "{% macro f(n) %}{{ f(n - 1) }}{{ f(n - 1) }}{% endmacro %}{{ f(60) }}",
    "{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}"
    "{{ f(40) }}",
    "{% set s = 'x' %}" + "{% set s = s ~ s %}" * 40 + "{{ s }}",
    "{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}"
    "{% endfor %}",
    "{% set s %}abcd{% endset %}" + "{% set s %}{{ s }}{{ s }}{% endset %}" * 40,
    "{% set ns = namespace(l=[1]) %}{% for i in range(60) %}{% set ns.l = ns.l + ns.l %}"
    "{% endfor %}",
    "{% macro f(s) %}{{ f(s ~ s) }}{% endmacro %}{{ f('x') }}",
    "{{ 'x' * 10**10 }}",
    "{{ [1] * 10**10 }}",
    "{{ 7 ** (10**8) }}",
    "{{ '%0999999999d' % 1 }}",
    "{{ '%.*f' % (999999999, 1) }}",
    "{{ '{:>999999999}'.format(1) }}",
    "{{ 'x'.ljust(10**9) }}",
    "{{ 'x'|center(10**9) }}",
    "{{ ('\t' * 1000)|string|attr('expandtabs')(99999) }}",
    "{{ ('\t' * 1000).expandtabs(99999) }}",
    "{{ ('a' * 100000)|replace('a', 'aaaaaaaaaa') }}",
    "{{ ('\n' * 10000)|indent(1000) }}",
    "{{ [1]|batch(10**9)|list }}",
    "{{ messages|tojson(indent=10**6) }}",
    "{% for i in range(10**9) %}{% endfor %}",
    "{% for i in range(90000) %}{{ 'yyyyyyyyyy' }}{% endfor %}",
    "{{ raise_exception('no system messages') }}",
    "{{ messages.append(1) }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}x{{ cycler.__init__.__globals__.os }}",
    "{% for %}",
]


@pytest.mark.parametrize("source", _HOSTILE)
def test_hostile_templates_are_bounded(source):
    before = sys.gettrace()
    start = time.monotonic()
    with pytest.raises(ChatTemplateError):
        out = ChatTemplate(source, _LIMITS).render([{"role": "user", "content": "hi"}])
        # A sandboxed template may render harmlessly; then it must not have escaped.
        if "<class" not in out and "module" not in out:
            raise ChatTemplateError("rendered harmlessly")
    assert time.monotonic() - start < 5.0
    assert sys.gettrace() is before


def test_time_bound_without_step_bound():
    limits = ChatTemplateLimits(max_steps=10**12, timeout_s=0.2)
    start = time.monotonic()
    with pytest.raises(ChatTemplateError, match="s$"):
        ChatTemplate(_HOSTILE[0], limits).render(_CONVERSATIONS[0])
    assert time.monotonic() - start < 2.0


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ("hello", "list"),
        ([], "at least one"),
        ([{"content": "no role"}], "role"),
        (["not a dict"], "role"),
        ([{"role": "user", "content": b"bytes"}], "unsupported"),
        ([{"role": "user", "content": object()}], "unsupported"),
        ([{"role": "user", "content": "x"}] * 5000, "too many"),
        ([{"role": "user", "content": "x" * (5 * 1024 * 1024)}], "too large"),
        ([{"role": "user", "content": [[[[[[[[[[[[[[[[[["deep"]]]]]]]]]]]]]]]]]]}], "deeper"),
        ([{"role": "user", "content": {1: "x"}}], "keys"),
    ],
)
def test_bad_messages_are_refused(tok, messages, match):
    with pytest.raises(ChatTemplateError, match=match):
        tok.apply_chat_template(messages)


def test_template_and_output_size_bounds():
    limits = ChatTemplateLimits(max_template_chars=100, max_output_chars=1000)
    with pytest.raises(ChatTemplateError, match="characters"):
        ChatTemplate("x" * 101, limits)
    t = ChatTemplate("{% for m in messages %}{{ m.content * 3 }}{% endfor %}", limits)
    assert t.render([{"role": "u", "content": "ab"}]) == "ababab"
    with pytest.raises(ChatTemplateError):
        t.render([{"role": "u", "content": "y" * 400}])


def test_model_without_or_with_broken_template(tmp_path, tiny_llama_dir):
    (tmp_path / "tokenizer.json").write_bytes((tiny_llama_dir / "tokenizer.json").read_bytes())
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.eos_token_ids == () and tok.bos_token_id is None
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tok.apply_chat_template([])
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% if %}"}))
    tok = Tokenizer.from_dir(tmp_path)  # loads; only chat fails
    assert tok.decode(tok.encode("ok", add_special_tokens=False)) == "ok"
    with pytest.raises(ChatTemplateError, match="invalid"):
        tok.apply_chat_template([])


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
