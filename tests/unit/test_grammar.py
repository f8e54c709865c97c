"""Constrained decoding, from the masks up: the bitmask kernel against a per-bit reference; the
grammar masks on random vocabularies against a plain regex reference; the engine (CPU, tiny
random-weight llama) giving schema-valid JSON for every seed, synchronous and asynchronous
steps alike, with free requests beside it unchanged."""

from __future__ import annotations

import json
import random

import pytest
import torch

jsonschema = pytest.importorskip("jsonschema")
regex = pytest.importorskip("regex")
pytest.importorskip("llguidance")

from agent.http.structured import json_grammar  # noqa: E402
from engine.core.engine_core import EngineCore  # noqa: E402
from engine.errors import RequestError  # noqa: E402
from engine.options import EngineOptions  # noqa: E402
from engine.grammar.compiler import GrammarCompiler, GrammarError  # noqa: E402
from engine.grammar.matcher import fill_masks  # noqa: E402
from engine.kernels.sample import apply_token_bitmask  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402
from engine.load_spec import LoadSpec  # noqa: E402
from text.tokenizer import Tokenizer, byte_to_unicode  # noqa: E402


def _bits(mask_row: torch.Tensor, vocab: int) -> set[int]:
    return {t for t in range(vocab) if (int(mask_row[t // 32]) >> (t % 32)) & 1}


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 100, 1000])
def test_bitmask_kernel_masks_exactly_the_clear_bits(vocab: int) -> None:
    g = torch.Generator().manual_seed(vocab)
    rows, words = 5, -(-vocab // 32)
    mask = torch.randint(-(1 << 31), (1 << 31) - 1, (rows, words), generator=g, dtype=torch.int64).to(torch.int32)
    logits = torch.randn(rows, vocab, generator=g)
    got = logits.clone()
    apply_token_bitmask(got, mask)
    for r in range(rows):
        allowed = _bits(mask[r], vocab)
        for t in range(vocab):
            assert (got[r, t] == logits[r, t]) if t in allowed else (got[r, t] == float("-inf"))


def _random_bpe(tmp_path, seed: int, merges: int = 120):
    """A byte-level BPE tokenizer.json with random merges over a small alphabet (so that
    multi-byte tokens often straddle what a grammar allows), plus one end-of-text token."""
    from tokenizers import Tokenizer as HfTokenizer, decoders, models, pre_tokenizers

    rng = random.Random(seed)
    b2u = byte_to_unicode()
    vocab = {b2u[b]: b for b in range(256)}
    alphabet = [b2u[ord(c)] for c in "abcxyz{}\":,0123456789"]
    pieces, merge_list = list(alphabet), []
    while len(merge_list) < merges:
        a, b = rng.choice(pieces), rng.choice(pieces)
        if a + b in vocab or len(a + b) > 6:
            continue
        merge_list.append((a, b))
        vocab[a + b] = len(vocab)
        pieces.append(a + b)
    tok = HfTokenizer(models.BPE(vocab=vocab, merges=merge_list))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|end|>"])
    path = tmp_path / f"tokenizer-{seed}.json"
    tok.save(str(path))
    u2b = {u: b for b, u in b2u.items()}
    token_bytes = {i: bytes(u2b[c] for c in s) for s, i in vocab.items()}
    return path, token_bytes, len(vocab)  # the special token's id is len(vocab)


@pytest.mark.parametrize("seed", range(4))
def test_masks_match_a_plain_regex_reference_on_random_vocabularies(tmp_path, seed: int) -> None:
    """At every step of a random walk through the grammar, a token is allowed exactly when the
    text so far plus its bytes can still become a full match (``regex``'s partial matching),
    and the end token exactly when the text is a full match already."""
    import llguidance

    path, token_bytes, n = _random_bpe(tmp_path, seed)
    eos, vocab = n, n + 1
    pattern = r'\{"[abc]{1,4}":(1[0-9]{0,2}|[xyz]+)(,"z":[0-9])?\}'
    comp = GrammarCompiler(path, vocab, [eos])
    g = comp.compile(llguidance.LLMatcher.grammar_from_regex(pattern)).result()
    rng = random.Random(seed)
    text = b""
    mask = torch.zeros((1, -(-vocab // 32)), dtype=torch.int32)
    for _ in range(40):
        fill_masks([(g, 0)], mask.data_ptr(), mask.shape[1] * 4, 1)
        got = _bits(mask[0], vocab)
        want = {t for t, b in token_bytes.items()
                if regex.fullmatch(pattern, (text + b).decode("latin-1"), partial=True)}
        if regex.fullmatch(pattern, text.decode("latin-1")):
            want.add(eos)
        assert got == want, f"after {text!r}: only ours {sorted(got - want)[:8]}, only the reference's {sorted(want - got)[:8]}"
        pick = rng.choice(sorted(got))
        assert g.accept(pick)
        if pick == eos:
            break
        text += token_bytes[pick]
    assert regex.fullmatch(pattern, text.decode("latin-1")), text
    comp.close()


def test_a_grammar_that_does_not_compile_fails_its_future(tmp_path) -> None:
    path, _, n = _random_bpe(tmp_path, 0, merges=4)
    comp = GrammarCompiler(path, n + 1, [n])
    with pytest.raises(GrammarError):
        comp.compile('{"grammars": [{"lark_grammar": "start: @@@"}]}').result()
    missing = GrammarCompiler(tmp_path / "absent.json", 10, [1])
    with pytest.raises(GrammarError, match="tokenizer"):
        missing.compile(json_grammar(None, False, "response_format")).result()
    comp.close()
    missing.close()


def test_compiled_grammars_are_cached_and_copies_are_independent(tmp_path) -> None:
    path, token_bytes, n = _random_bpe(tmp_path, 1)
    comp = GrammarCompiler(path, n + 1, [n])
    grammar = json_grammar({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
                            "additionalProperties": False}, True, "x")
    first = comp.compile(grammar).result()
    second = comp.compile(grammar).result()
    assert (comp.compiled, comp.hits) == (1, 1)
    brace = next(t for t, b in token_bytes.items() if b == b"{")
    assert first.accept(brace)
    assert not second.finished and second.accept(brace)  # the copy did not see the first's token
    comp.close()


SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "ok": {"type": "boolean"},
                         "color": {"enum": ["red", "green", "blue"]},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2}},
          "required": ["name", "age", "ok", "color", "tags"], "additionalProperties": False}


def _run(model_dir, async_steps: bool, constrained: bool, seeds: range):
    core = EngineCore(EngineOptions(async_steps=async_steps, async_on_cpu=True), device="cpu")
    core.load_model(LoadSpec("m", model_dir, max_model_len=512, max_num_seqs=16))
    tok = Tokenizer.from_dir(model_dir)
    prompt = tok.encode("give me a record")
    grammar = json_grammar(SCHEMA, True, "x")
    for i in seeds:
        if constrained:
            core.add_request(f"c{i}", "m", prompt, SamplingParams(temperature=1.0, seed=i, max_tokens=300),
                             grammar=core.compile_grammar("m", grammar).result())
        core.add_request(f"f{i}", "m", prompt, SamplingParams(temperature=1.0, seed=i, max_tokens=12, ignore_eos=True))
    toks: dict[str, list[int]] = {}
    finish: dict[str, str] = {}
    while core.has_unfinished_requests():
        for o in core.step():
            toks.setdefault(o.req_id, []).extend(o.new_token_ids)
            if o.finish_reason:
                finish[o.req_id] = o.finish_reason
    eos = set(core.slots.get("m").config.eos_token_ids)
    return core, tok, eos, toks, finish


@pytest.mark.parametrize("async_steps", [False, True])
def test_every_seed_gives_json_valid_for_the_schema(make_tiny_model, async_steps: bool) -> None:
    """Random weights write noise; only the grammar can make every answer valid."""
    model_dir = make_tiny_model("llama")
    core, tok, eos, toks, finish = _run(model_dir, async_steps, True, range(12))
    for i in range(12):
        assert finish[f"c{i}"] == "stop"
        value = json.loads(tok.decode([t for t in toks[f"c{i}"] if t not in eos]))
        jsonschema.validate(value, SCHEMA)
        assert list(value) == list(SCHEMA["properties"])  # the schema's order
    stats = core.stats()["m"]
    assert stats.constrained and stats.grammar_compiles == 1 and stats.grammar_cache_hits == 11
    assert stats.grammar_masked_rows >= sum(len(toks[f"c{i}"]) for i in range(12))


def test_steps_and_neighbours_do_not_change_tokens(make_tiny_model) -> None:
    """Seeded sampling: asynchronous steps give the synchronous tokens, and free requests sharing
    the batch with constrained ones give what they give alone."""
    model_dir = make_tiny_model("llama")
    _, _, _, sync, _ = _run(model_dir, False, True, range(6))
    _, _, _, asyn, _ = _run(model_dir, True, True, range(6))
    _, _, _, alone, _ = _run(model_dir, True, False, range(6))
    assert sync == asyn
    assert {k: v for k, v in asyn.items() if k.startswith("f")} == alone


def test_a_constrained_request_resumed_mid_value_finishes_the_same_valid_value(make_tiny_model) -> None:
    """A request preempted mid-answer resumes with the output it had (``output_token_ids``): its
    grammar takes that output first, so the seeded answer is the uninterrupted one, still valid;
    output the grammar would not have allowed is refused, naming the field."""
    model_dir = make_tiny_model("llama")
    core, tok, eos, toks, finish = _run(model_dir, True, True, range(3))
    grammar = json_grammar(SCHEMA, True, "x")
    prompt = tok.encode("give me a record")
    for i in range(3):
        whole = toks[f"c{i}"]
        cut = len(whole) // 2
        core.add_request(f"r{i}", "m", prompt, SamplingParams(temperature=1.0, seed=i, max_tokens=300),
                         grammar=core.compile_grammar("m", grammar).result(), output_token_ids=whole[:cut])
        rest: list[int] = []
        while core.has_unfinished_requests():
            for o in core.step():
                rest.extend(o.new_token_ids)
        assert whole[:cut] + rest == whole
        jsonschema.validate(json.loads(tok.decode([t for t in whole if t not in eos])), SCHEMA)
    not_json = tok.encode("}}")
    with pytest.raises(RequestError) as e:
        core.add_request("bad", "m", prompt, SamplingParams(max_tokens=300),
                         grammar=core.compile_grammar("m", grammar).result(), output_token_ids=not_json)
    assert e.value.param == "output_token_ids"
