"""From an OpenAI ``response_format``, or a forced tool call, to the grammar the engine constrains
decoding with.

The agent turns the request's format into an llguidance grammar (JSON text) and checks it here,
so a bad schema is a 400 naming ``response_format`` before anything is queued and the worker
never sees it; the worker compiles the grammar against the model's vocabulary
(engine/grammar/compiler.py). Checking runs in a thread, bounded by ``CHECK_TIMEOUT_S``, and the
result (grammar or refusal) is kept by the schema's text, so a repeated schema costs a lookup.

Output is compact JSON (no optional whitespace): with free whitespace a model, and any model
with random weights, can spend its whole budget on spaces, which is valid and useless.
``strict`` true refuses a schema with a keyword the grammar cannot enforce; false (OpenAI's
default) lets such keywords through unenforced.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from agent.http.openai_schema import ResponseFormat
from text.tool_calls import ToolFormat

CHECK_TIMEOUT_S = 2.0
CACHE_ENTRIES = 512
# The options every JSON grammar is compiled with (llguidance's JsonCompileOptions).
_COMPACT = {"whitespace_flexible": False}


class StructuredOutputError(ValueError):
    """A format that cannot be enforced; ``param`` names the field for the 400."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


@dataclass(frozen=True)
class ForcedCall:
    """Output that must be a tool call (``tool_choice`` required, or one named tool)."""

    fmt: ToolFormat  # how the model writes calls
    tools: list[dict[str, Any]]  # the functions it may call (name, description, parameters, strict)
    parallel: bool  # one call or more

    @property
    def strict(self) -> bool:
        """Any of the functions asks for strict parameters: the grammar then enforces every keyword."""
        return any(t.get("strict") for t in self.tools)


def json_grammar(schema: dict[str, Any] | None, strict: bool, param: str) -> str:
    """The grammar of JSON values matching ``schema`` (None: any JSON object); raises
    :class:`StructuredOutputError` when it cannot be compiled."""
    import llguidance

    text = json.dumps({"type": "object"} if schema is None else closed_objects(schema), separators=(",", ":"))
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(text, defaults={**_COMPACT, "lenient": not strict})
    except ValueError as e:
        raise StructuredOutputError(param, f"{param}: not a JSON schema: {e}") from None
    return _checked(grammar, param, "the schema")


# Keywords whose value is one subschema, or a list or map of them (JSON Schema 2020-12 and draft 7).
_SUB_ONE = ("additionalProperties", "unevaluatedProperties", "items", "additionalItems", "unevaluatedItems",
            "contains", "not", "if", "then", "else", "propertyNames")
_SUB_LIST = ("anyOf", "oneOf", "prefixItems", "items")
_SUB_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def closed_objects(schema: Any, in_all_of: bool = False) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object schema that declares
    ``properties`` (or ``patternProperties``) and says nothing of keys beyond them
    (``additionalProperties`` / ``unevaluatedProperties``): an answer has the keys the schema
    names and no others, as vLLM's default backend (xgrammar, ``strict_mode``) writes them. An
    object without declared properties (``{"type": "object"}``) stays any object; the members of
    an ``allOf`` are left as written (closing each would forbid the others' keys). See
    docs/engine.md, "Structured outputs", for the evidence."""
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for k, v in schema.items():
        if k in _SUB_MAP and isinstance(v, dict):
            out[k] = {name: closed_objects(sub) for name, sub in v.items()}
        elif k in _SUB_LIST and isinstance(v, list):
            out[k] = [closed_objects(sub) for sub in v]
        elif k == "allOf" and isinstance(v, list):
            out[k] = [closed_objects(sub, in_all_of=True) for sub in v]
        elif k in _SUB_ONE:
            out[k] = closed_objects(v)
        else:
            out[k] = v
    if (not in_all_of and ("properties" in schema or "patternProperties" in schema)
            and "additionalProperties" not in schema and "unevaluatedProperties" not in schema):
        out["additionalProperties"] = False
    return out


def _checked(grammar: str, param: str, what: str) -> str:
    """``grammar`` once llguidance, under the worker's parser limits, finds it enforceable."""
    import llguidance

    from engine.grammar.compiler import parser_limits

    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, None, limits=parser_limits())
    if is_error:
        raise StructuredOutputError(param, f"{param}: {what} cannot be enforced: {messages[0]}")
    return grammar


def tool_call_grammar(fmt: ToolFormat, tools: list[dict[str, Any]], parallel: bool, strict: bool) -> str:
    """The grammar of a forced call (``tool_choice`` required, or the one named tool when
    ``tools`` holds only it): the format's wrapping around JSON naming one of ``tools`` with
    arguments valid for its parameters; raises :class:`StructuredOutputError` (param ``tools``)."""
    import llguidance

    key = fmt.args_key
    options = {**_COMPACT, "lenient": not strict}
    calls = [{"type": "object",
              "properties": {"name": {"const": t["name"]}, key: closed_objects(t.get("parameters") or {})},
              "required": ["name", key], "additionalProperties": False} for t in tools]
    schema = {**(calls[0] if len(calls) == 1 else {"anyOf": calls}), "x-guidance": options}
    try:
        grammar = llguidance.LLMatcher.grammar_from_lark(fmt.lark(schema, parallel))
    except ValueError as e:
        raise StructuredOutputError("tools", f"tools: {e}") from None
    return _checked(grammar, "tools", "the parameters")


class GrammarBuilder:
    """Grammars for request formats, checked off the event loop and kept by schema.

    ``checks`` and ``check_seconds`` count the schemas actually compiled (cache misses)."""

    def __init__(self, entries: int = CACHE_ENTRIES, timeout_s: float = CHECK_TIMEOUT_S) -> None:
        self._cache: OrderedDict[tuple[object, ...], str | StructuredOutputError] = OrderedDict()
        self._entries = entries
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self.checks = 0
        self.check_seconds = 0.0

    async def grammar(self, constraint: ResponseFormat | ForcedCall | None) -> str:
        """``""`` for free text (no format, or type ``text``), else the grammar's text; raises
        :class:`StructuredOutputError`."""
        if isinstance(constraint, ForcedCall):
            return await self._tool_grammar(constraint)
        return await self._format_grammar(constraint)

    async def _format_grammar(self, response_format: ResponseFormat | None) -> str:
        if response_format is None or response_format.type == "text":
            return ""
        if response_format.type == "json_object":
            key: tuple[str, str, bool] = ("json_object", "", False)
            schema, strict, param = None, False, "response_format"
        else:
            js = response_format.json_schema
            assert js is not None  # the schema's validator: json_schema comes with its type
            schema, strict, param = js.json_schema, bool(js.strict), "response_format.json_schema.schema"
            # property order is the output's order: the key keeps it
            key = ("json_schema", json.dumps(schema, separators=(",", ":")), strict)
        return await self._cached(key, lambda: self._timed(json_grammar, schema, strict, param), param)

    async def _cached(self, key: tuple[object, ...], build: Callable[[], str], param: str) -> str:
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
        if hit is None:
            try:
                hit = await asyncio.wait_for(asyncio.to_thread(build), self._timeout_s)
            except StructuredOutputError as e:
                hit = e
            except asyncio.TimeoutError:
                # not kept: a slow check may be the machine's load, not the schema
                raise StructuredOutputError(param, f"{param}: the schema took over {self._timeout_s:g} s to "
                                                   "compile; simplify it") from None
            with self._lock:
                self._cache[key] = hit
                while len(self._cache) > self._entries:
                    self._cache.popitem(last=False)
        if isinstance(hit, StructuredOutputError):
            raise hit
        return hit

    async def _tool_grammar(self, call: ForcedCall) -> str:
        """:func:`tool_call_grammar`, off the event loop and kept like the schemas."""
        strict = call.strict
        key = ("tools:" + call.fmt.name, json.dumps(call.tools, separators=(",", ":")), strict, call.parallel)
        return await self._cached(key, lambda: self._timed(tool_call_grammar, call.fmt, call.tools, call.parallel,
                                                           strict), "tools")

    def _timed(self, fn: Callable[..., str], *args: object) -> str:
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            with self._lock:
                self.checks += 1
                self.check_seconds += time.perf_counter() - t0
