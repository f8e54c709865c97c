"""Which keys a JSON answer may have (issue 36, item 7; docs/engine.md, "Structured outputs"): an
object schema that declares properties and says nothing of others gets only those, strict or
not, in response_format and in a forced call's arguments, as vLLM's default backend (xgrammar);
a declared key never comes twice; keys beyond the declared ones come only where the schema asks
for them (``additionalProperties``), and ``json_object`` / ``{"type": "object"}`` is any object.
Checked on the grammar matcher itself, byte by byte, over a byte-level vocabulary: what it
refuses no model can write."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("llguidance")

from agent.http.structured import closed_objects, json_grammar, tool_call_grammar  # noqa: E402
from engine.grammar.compiler import GrammarCompiler  # noqa: E402
from text.tokenizer import byte_to_unicode  # noqa: E402
from text.tool_calls import ToolFormat  # noqa: E402

EOS = 256


@pytest.fixture(scope="module")
def compiler(tmp_path_factory):
    from tokenizers import Tokenizer as HfTokenizer, decoders, models, pre_tokenizers

    b2u = byte_to_unicode()
    tok = HfTokenizer(models.BPE(vocab={b2u[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|end|>"])
    path = tmp_path_factory.mktemp("bytes") / "tokenizer.json"
    tok.save(str(path))
    comp = GrammarCompiler(path, 257, [EOS])
    yield comp
    comp.close()


def _writable(compiler, grammar: str, text: str) -> bool:
    """Whether a model constrained by ``grammar`` can write exactly ``text`` and end."""
    g = compiler.compile(grammar).result()
    return all(g.accept(b) for b in text.encode()) and (g.finished or g.accept(EOS))


OPEN = {"type": "object", "properties": {"a": {"type": "integer"},
                                         "o": {"type": "object", "properties": {"x": {"type": "boolean"}}}}}


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("text, ok", [
    ('{"a":1}', True),
    ('{"a":1,"o":{"x":true}}', True),
    ("{}", True),
    ('{"a":1,"b":2}', False),  # a key the schema does not name
    ('{"b":2}', False),
    ('{"a":1,"o":{"x":true,"y":1}}', False),  # ... in a nested object too
    ('{"a":1,"a":2}', False),  # a declared key twice
])
def test_a_schema_that_names_its_keys_gets_only_those(compiler, strict, text, ok) -> None:
    assert _writable(compiler, json_grammar(OPEN, strict, "x"), text) is ok


@pytest.mark.parametrize("schema, text, ok", [
    ({**OPEN, "additionalProperties": True}, '{"a":1,"b":2}', True),  # asked for: allowed
    ({**OPEN, "additionalProperties": True}, '{"a":1,"a":2}', False),  # but never a declared key again
    ({**OPEN, "additionalProperties": {"type": "string"}}, '{"a":1,"b":"s"}', True),
    ({**OPEN, "additionalProperties": {"type": "string"}}, '{"a":1,"b":2}', False),
    ({"type": "object"}, '{"b":2,"c":[]}', True),  # no declared keys: any object
    ({"type": "object", "additionalProperties": {"type": "integer"}}, '{"k":1}', True),
    ({"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}},
                {"type": "object", "properties": {"b": {"type": "integer"}}}]}, '{"a":1,"b":2}', True),
])
def test_keys_beyond_the_declared_ones_come_where_the_schema_asks(compiler, schema, text, ok) -> None:
    assert _writable(compiler, json_grammar(schema, False, "x"), text) is ok


def test_json_object_is_any_object(compiler) -> None:
    grammar = json_grammar(None, False, "response_format")
    for text in ('{"a":1,"b":{"c":null}}', "{}"):
        assert _writable(compiler, grammar, text)
    assert not _writable(compiler, grammar, "[1]")
    # Keys that no schema names can repeat: no context-free grammar excludes that (nor do
    # vLLM's backends; OpenAI's JSON mode promises valid JSON only). Documented, pinned here.
    assert _writable(compiler, grammar, '{"a":1,"a":2}')


def test_a_forced_calls_arguments_get_only_the_declared_parameters(compiler) -> None:
    tools = [{"name": "f", "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}]
    grammar = tool_call_grammar(ToolFormat("llama3", True), tools, False, False)
    assert _writable(compiler, grammar, '{"name":"f","parameters":{"q":"x"}}')
    assert not _writable(compiler, grammar, '{"name":"f","parameters":{"q":"x","rm":"-rf"}}')


def test_closed_objects_walks_subschemas_not_data() -> None:
    schema = {"type": "object", "properties": {"properties": {"type": "object", "properties": {"k": {}}}},
              "$defs": {"D": {"properties": {"z": {}}}}, "items": [{"properties": {}}],
              "anyOf": [{"type": "object", "properties": {"p": {}}, "unevaluatedProperties": True}]}
    before = json.dumps(schema)
    got = closed_objects(schema)
    assert json.dumps(schema) == before  # the request's schema is not changed in place
    assert got["additionalProperties"] is False
    assert got["properties"]["properties"]["additionalProperties"] is False
    assert "additionalProperties" not in got["properties"]["properties"]["properties"]  # a map of names
    assert got["$defs"]["D"]["additionalProperties"] is False
    assert got["items"][0]["additionalProperties"] is False
    assert "additionalProperties" not in got["anyOf"][0]
    assert closed_objects({"type": "object"}) == {"type": "object"}
