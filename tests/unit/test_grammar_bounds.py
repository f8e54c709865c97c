"""Grammar bombs (issue 36, items 12-14) are refused or stopped, bounded in time and memory:
multipleOf values whose lexer would take the worker minutes, an allOf of patterns whose check
doubles the agent's memory with each one, literals whose masks slow every step; checks run in
killable child processes, off asyncio's default pool; the worker's compile cache is bounded by
size; a request whose masks go over their budget ends with an error, alone."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading
import time

import pytest

pytest.importorskip("llguidance")

from agent.http.structured import (GrammarBuilder, StructuredOutputError, json_grammar,  # noqa: E402
                                   tool_call_grammar)
from engine.grammar import compiler as compiler_mod, matcher as matcher_mod  # noqa: E402
from engine.grammar.compiler import GrammarCompiler  # noqa: E402
from engine.grammar.matcher import fill_masks  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402
from tests.unit.test_grammar import _random_bpe  # noqa: E402
from text.tool_calls import ToolFormat  # noqa: E402

PARAM = "response_format.json_schema.schema"
# An allOf of patterns each demanding one more letter: llguidance's check doubles its memory per
# pattern (18: 5 s and 530 MB; 20: over 30 s, over 1 GB on this box).
ALLOF_BOMB = {"allOf": [{"type": "string", "pattern": f".*{chr(97 + i)}.*"} for i in range(20)]}


class _FakeResponseFormat:
    def __init__(self, schema, strict=True):
        self.type = "json_schema"
        self.json_schema = type("JS", (), {"json_schema": schema, "strict": strict})()


@pytest.mark.parametrize("value", [523457, 1234567, 12345679, 5234.57])
def test_large_multiple_of_is_refused_at_once(value) -> None:
    t0 = time.perf_counter()
    with pytest.raises(StructuredOutputError, match="multipleOf") as e:
        json_grammar({"type": "integer" if isinstance(value, int) else "number", "multipleOf": value}, True, PARAM)
    assert e.value.param == PARAM
    tools = [{"name": "f", "parameters": {"type": "object", "properties": {"n": {"type": "integer",
                                                                              "multipleOf": value}}}}]
    with pytest.raises(StructuredOutputError, match="multipleOf") as e:
        tool_call_grammar(ToolFormat("hermes", False), tools, False, False)
    assert e.value.param == "tools"
    assert time.perf_counter() - t0 < 0.5


def test_multiple_of_values_add_up_and_common_ones_pass() -> None:
    for ok in (0.01, 0.5, 5, 15, 3600, 86400, 1_000_000, 9999):
        json_grammar({"type": "number", "multipleOf": ok}, True, PARAM)
    props = {f"p{i}": {"type": "integer", "multipleOf": 9999 - i} for i in range(20)}  # 0.7 s of compile
    with pytest.raises(StructuredOutputError, match="multipleOf"):
        json_grammar({"type": "object", "properties": props}, True, PARAM)
    # a property named after a keyword is a name, not the keyword
    json_grammar({"type": "object", "properties": {"const": {"type": "string", "description": "x" * 2000},
                                                   "multipleOf": {"type": "integer"}}}, True, PARAM)


@pytest.mark.parametrize("schema", [{"const": "x" * 60_000}, {"enum": ["a", "b" * 5000]},
                                    {"type": "string", "pattern": "^a{60000}$"},
                                    {"type": "string", "pattern": "^(ab){2,5000}$"},
                                    {"type": "object", "properties": {"k" * 5000: {"type": "string"}}}])
def test_literals_costly_to_mask_with_are_refused(schema) -> None:
    with pytest.raises(StructuredOutputError, match="too costly"):
        json_grammar(schema, False, PARAM)


def _blocked_default_executor(loop: asyncio.AbstractEventLoop) -> threading.Event:
    """asyncio's default pool, one thread, kept busy until the event is set."""
    release = threading.Event()
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    loop.set_default_executor(pool)
    loop.run_in_executor(None, release.wait)
    return release


def test_allof_bomb_is_refused_bounded_and_off_the_default_pool() -> None:
    async def main():
        release = _blocked_default_executor(asyncio.get_running_loop())
        b = GrammarBuilder(timeout_s=0.5, processes=2)
        try:
            t0 = time.perf_counter()
            bombs = [b.grammar(_FakeResponseFormat(ALLOF_BOMB, strict)) for strict in (True, False) * 2]
            results = await asyncio.gather(*bombs, return_exceptions=True)
            spent = time.perf_counter() - t0
            assert all(isinstance(r, StructuredOutputError) and r.param == PARAM for r in results), results
            assert "simplify it" in results[0].message
            assert spent < 4.0  # two rounds of two children, each killed at 0.5 s (plus their start)
            assert b.check_kills >= 1
            # the children were killed: the next schema is checked at once, the default pool still blocked
            t1 = time.perf_counter()
            grammar = await b.grammar(_FakeResponseFormat({"type": "object", "properties": {"a": {"type": "integer"}}}))
            assert json.loads(grammar)["grammars"] and time.perf_counter() - t1 < 1.5
        finally:
            release.set()
            await b.aclose()
    asyncio.run(main())


def test_a_check_whose_request_ends_is_killed() -> None:
    async def main():
        b = GrammarBuilder(timeout_s=30.0, processes=1)
        task = asyncio.create_task(b.grammar(_FakeResponseFormat(ALLOF_BOMB)))
        for _ in range(100):
            await asyncio.sleep(0.05)
            if b._slots is not None and b._slots.locked():
                break
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert b.check_kills == 1 and not b._idle
        # the one slot is free again: a plain schema is checked in a fresh child
        await asyncio.wait_for(b.grammar(_FakeResponseFormat({"type": "string"})), 5.0)
        await b.aclose()
    asyncio.run(main())


def test_a_check_over_its_memory_is_refused(monkeypatch) -> None:
    async def main():
        b = GrammarBuilder(timeout_s=20.0, processes=1, memory_bytes=300 << 20)
        t0 = time.perf_counter()
        with pytest.raises(StructuredOutputError, match="MiB"):
            await b.grammar(_FakeResponseFormat(ALLOF_BOMB))
        assert time.perf_counter() - t0 < 10.0
        await b.aclose()
    asyncio.run(main())


def test_the_compile_cache_is_bounded_by_size(tmp_path, monkeypatch) -> None:
    path, _, n = _random_bpe(tmp_path, 2, merges=30)
    comp = GrammarCompiler(path, n + 1, [n])
    grammars = [json_grammar({"type": "object", "properties": {f"k{i}_{j}": {"type": "string"} for j in range(8)}},
                             True, "x") for i in range(12)]
    monkeypatch.setattr(compiler_mod, "BYTES_PER_COMPILE_SECOND", 0)  # sizes by text alone: deterministic
    monkeypatch.setattr(compiler_mod, "CACHE_BYTES", 3 * compiler_mod.estimated_bytes(max(grammars, key=len), 0.0))
    for g in grammars:
        comp.compile(g).result()
    assert len(comp._cache) == 3 and comp.cache_bytes <= compiler_mod.CACHE_BYTES
    assert comp.cache_bytes == sum(size for _, size in comp._cache.values())
    # one grammar over the entry bound is compiled, not kept
    monkeypatch.setattr(compiler_mod, "CACHE_ENTRY_MAX_BYTES", 1)
    before = dict(comp._cache)
    comp.compile(json_grammar({"type": "integer"}, True, "x")).result()
    assert comp._cache.keys() == before.keys()
    comp.close()


def test_a_queued_compile_is_cancelled(tmp_path) -> None:
    path, _, n = _random_bpe(tmp_path, 3, merges=10)
    comp = GrammarCompiler(path, n + 1, [n])
    gate = threading.Event()
    comp._pool.submit(gate.wait)  # the grammar thread is busy
    f = comp.compile(json_grammar({"type": "integer"}, True, "x"))
    assert f.cancel()
    gate.set()
    comp.close()
    assert comp.compiled == 0


def _costly_and_cheap(tmp_path):
    """Two grammars over one vocabulary: a 60,000-character const (the agent refuses it; the
    engine must still bound it) and a small object."""
    import llguidance

    path, _, n = _random_bpe(tmp_path, 4, merges=60)
    comp = GrammarCompiler(path, n + 1, [n])
    costly = llguidance.LLMatcher.grammar_from_json_schema(json.dumps({"const": "xyzab" * 12_000}),
                                                           defaults={"whitespace_flexible": False})
    cheap = json_grammar({"type": "object", "properties": {"a": {"type": "integer"}}}, True, "x")
    return comp, comp.compile(costly).result(), comp.compile(cheap).result(), n + 1


def test_masks_over_budget_fail_the_costly_grammar_only(tmp_path, monkeypatch) -> None:
    import numpy as np

    comp, costly, cheap, vocab = _costly_and_cheap(tmp_path)
    words = -(-vocab // 32)
    buf = np.zeros((2, words), dtype=np.int32)
    t = time.perf_counter()
    fill_masks([(costly, 0)], buf.ctypes.data, words * 4, 2)
    one = time.perf_counter() - t
    # budgets scaled to this vocabulary: the const's mask is over, the object's far under
    monkeypatch.setattr(matcher_mod, "MASK_ROW_BUDGET_S", one / 50)
    monkeypatch.setattr(matcher_mod, "MASK_EXCESS_S", one / 5)
    steps = 0
    while not costly.finished and steps < 20:
        fill_masks([(costly, 0), (cheap, 1)], buf.ctypes.data, words * 4, 2)
        steps += 1
    assert costly.error is not None and "too costly" in costly.error
    assert cheap.error is None and not cheap.watched and cheap.mask_excess == 0
    assert steps <= 5
    comp.close()


def test_the_engine_ends_a_request_over_its_mask_budget_with_its_error(make_tiny_model, monkeypatch) -> None:
    from engine.core.engine_core import EngineCore
    from engine.load_spec import LoadSpec
    from engine.options import EngineOptions
    from text.tokenizer import Tokenizer

    model_dir = make_tiny_model("llama")
    core = EngineCore(EngineOptions(), device="cpu")
    core.load_model(LoadSpec("m", model_dir, max_model_len=256, max_num_seqs=4))
    prompt = Tokenizer.from_dir(model_dir).encode("hi")
    grammar = json_grammar({"type": "string", "maxLength": 40}, True, "x")
    monkeypatch.setattr(matcher_mod, "MASK_ROW_BUDGET_S", -1.0)  # every mask is over
    monkeypatch.setattr(matcher_mod, "MASK_EXCESS_S", 0.0)
    core.add_request("c", "m", prompt, SamplingParams(temperature=1.0, seed=1, max_tokens=30),
                     grammar=core.compile_grammar("m", grammar).result())
    core.add_request("f", "m", prompt, SamplingParams(temperature=1.0, seed=1, max_tokens=6, ignore_eos=True))
    finish = {}
    toks: dict[str, list[int]] = {}
    while core.has_unfinished_requests():
        for o in core.step():
            toks.setdefault(o.req_id, []).extend(o.new_token_ids)
            if o.finish_reason:
                finish[o.req_id] = o.finish_reason
    assert finish == {"c": "abort", "f": "length"} and len(toks["f"]) == 6
    assert "too costly" in core.grammar_errors["c"]


# Schemas no finite value satisfies: llguidance compiles them, then allows no token (or only an
# endless value), and the answer ended as "stop" with "" or "{" (a second attacker's finding).
NO_FINITE_VALUE = {
    "itself": {"$ref": "#"},
    "a-pair-of-definitions": {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
    "a-required-property-of-its-own-type": {
        "$defs": {"a": {"type": "object", "properties": {"x": {"$ref": "#/$defs/a"}}, "required": ["x"]}},
        "$ref": "#/$defs/a"},
    "a-non-empty-array-of-itself": {"type": "array", "items": {"$ref": "#"}, "minItems": 1},
    "every-branch-a-cycle": {"anyOf": [{"$ref": "#"}, {"allOf": [{"$ref": "#"}]}]},
}
FINITE_RECURSION = {
    "a-tree": {"$defs": {"n": {"type": "object", "required": ["kids"],
                               "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/n"}}}}},
               "$ref": "#/$defs/n"},
    "an-optional-property-of-its-own-type": {"type": "object", "properties": {"x": {"$ref": "#"}}},
    "a-branch-out": {"anyOf": [{"$ref": "#"}, {"type": "null"}]},
    "a-linked-list": {"$defs": {"l": {"anyOf": [{"type": "null"}, {"type": "object", "required": ["next"],
                                                                  "properties": {"next": {"$ref": "#/$defs/l"}}}]}},
                      "$ref": "#/$defs/l"},
}


@pytest.mark.parametrize("schema", NO_FINITE_VALUE.values(), ids=NO_FINITE_VALUE.keys())
def test_a_schema_no_finite_value_satisfies_is_refused(schema) -> None:
    for strict in (True, False):
        with pytest.raises(StructuredOutputError, match="no finite JSON value") as e:
            json_grammar(schema, strict, PARAM)
        assert e.value.param == PARAM


def test_a_tools_parameters_no_finite_value_satisfies_are_refused() -> None:
    params = NO_FINITE_VALUE["a-required-property-of-its-own-type"]
    with pytest.raises(StructuredOutputError, match="no finite JSON value") as e:
        tool_call_grammar(ToolFormat("hermes", False), [{"name": "f", "parameters": params}], False, True)
    assert e.value.param == "tools"


@pytest.mark.parametrize("schema", FINITE_RECURSION.values(), ids=FINITE_RECURSION.keys())
def test_recursive_schemas_with_a_way_out_are_taken(schema) -> None:
    assert json_grammar(schema, True, PARAM)


def test_a_reference_chain_built_to_be_exponential_is_given_up_on_not_searched() -> None:
    # each definition refers to the next twice, the last to the first: 2^40 paths
    defs = {f"d{i}": {"anyOf": [{"$ref": f"#/$defs/d{i + 1}"}, {"$ref": f"#/$defs/d{i + 1}"}]} for i in range(40)}
    defs["d40"] = {"$ref": "#/$defs/d0"}
    t0 = time.perf_counter()
    from agent.http.structured import finite_value_check
    finite_value_check({"$defs": defs, "$ref": "#/$defs/d0"}, PARAM)  # taken: the engine's end holds
    assert time.perf_counter() - t0 < 5.0


@pytest.mark.parametrize("bound, past", [("minimum", 1), ("exclusiveMinimum", 1), ("maximum", -1),
                                         ("exclusiveMaximum", -1)])
def test_integer_bounds_the_grammar_would_widen_are_refused(bound, past) -> None:
    # 10**300 as a minimum let 9223372036854775807 through as a "strict" answer: a lower bound past
    # 64 bits' top (an upper one past the bottom) would be clamped to a wider range
    with pytest.raises(StructuredOutputError, match="64 bits") as e:
        json_grammar({"type": "integer", bound: past * 10 ** 300}, True, PARAM)
    assert e.value.param == PARAM and "digits) is beyond" in e.value.message
    with pytest.raises(StructuredOutputError, match="64 bits"):  # past a float's range too: no float in the message
        json_grammar({"type": "integer", bound: past * 10 ** 400}, True, PARAM)
    with pytest.raises(StructuredOutputError, match="64 bits"):
        json_grammar({"type": "integer", bound: past * (1 << 63) + (0 if past > 0 else -1)}, True, PARAM)
    assert json_grammar({"type": "integer", bound: past * 10 ** 12}, True, PARAM)
    # the other way the clamp narrows, and is served: a uint64 field
    assert json_grammar({"type": "integer", "minimum": 0, "maximum": (1 << 64) - 1}, True, PARAM)


def test_a_required_key_a_pattern_takes_is_finite() -> None:
    schema = {"type": "object", "required": ["x"], "patternProperties": {"^x$": {"type": "string"}},
              "additionalProperties": False}
    assert json_grammar(schema, True, PARAM)


def test_the_engine_ends_a_request_whose_grammar_allows_no_token_with_an_error(make_tiny_model) -> None:
    """Past the agent's check (a cycle it gave up on, llguidance's own failure), the engine
    never reports a value the grammar did not complete as a finished answer."""
    import llguidance

    from engine.core.engine_core import EngineCore
    from engine.load_spec import LoadSpec
    from engine.options import EngineOptions
    from text.tokenizer import Tokenizer

    model_dir = make_tiny_model("llama")
    core = EngineCore(EngineOptions(), device="cpu")
    core.load_model(LoadSpec("m", model_dir, max_model_len=256, max_num_seqs=4))
    prompt = Tokenizer.from_dir(model_dir).encode("hi")
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(NO_FINITE_VALUE["itself"]))
    core.add_request("c", "m", prompt, SamplingParams(temperature=1.0, seed=1, max_tokens=30),
                     grammar=core.compile_grammar("m", grammar).result())
    core.add_request("f", "m", prompt, SamplingParams(temperature=1.0, seed=1, max_tokens=6, ignore_eos=True))
    finish = {}
    while core.has_unfinished_requests():
        for o in core.step():
            if o.finish_reason:
                finish[o.req_id] = o.finish_reason
    assert finish == {"c": "abort", "f": "length"}
    assert "allows no further token" in core.grammar_errors["c"]
