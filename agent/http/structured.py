"""From an OpenAI ``response_format``, or a forced tool call, to the grammar the engine constrains
decoding with.

The agent turns the request's format into an llguidance grammar (JSON text) and checks it here,
so a bad schema is a 400 naming ``response_format`` before anything is queued and the worker
never sees it; the worker compiles the grammar against the model's vocabulary
(engine/grammar/compiler.py). The result (grammar or refusal) is kept by the schema's text, so a
repeated schema costs a lookup.

Checks are bounded (docs/engine.md, "Bounds"): a schema whose grammar would be costly to compile
or to mask with (``multipleOf`` values, long literals, long counted repetitions) is refused by
:func:`schema_bounds` before llguidance sees it, and llguidance's own check runs in a child
process of its own (:mod:`agent.http.grammar_check`), never in the agent's threads: at most
``CHECK_PROCESSES`` at once, each capped at ``CHECK_MEMORY_BYTES`` of address space and killed
when it runs over ``CHECK_TIMEOUT_S`` or its request goes away. A schema that hits a bound is a 400.

Output is compact JSON (no optional whitespace): with free whitespace a model, and any model
with random weights, can spend its whole budget on spaces, which is valid and useless.
``strict`` true refuses a schema with a keyword the grammar cannot enforce; false (OpenAI's
default) lets such keywords through unenforced.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any

from agent.http.openai_schema import ResponseFormat
from text.tool_calls import ToolFormat

CHECK_TIMEOUT_S = 2.0
CACHE_ENTRIES = 512
# The check's child processes: how many run at once (more checks wait their turn), and the
# address space each may map (llguidance's state for a hostile regex grows without bound).
CHECK_PROCESSES = 2
CHECK_MEMORY_BYTES = 1 << 30
# What one schema may ask of the grammar (schema_bounds). The worker's compile grows with each
# multipleOf's significant digits (a value n builds a lexer of about n states: 9,999 took 35 ms and
# 1.3 MB, 523,457 took 5.6 s and 280 MB on the CPU box), so the schema's values may add up to
# MAX_MULTIPLE_OF (1.5 is 15, 3600 is 36). A literal (const, enum member, property name) or a
# counted repetition in a pattern costs every mask of the request about its length (a 60,000
# character const: 15 ms a step, 97 ms the first), so each is at most MAX_LITERAL_CHARS.
MAX_MULTIPLE_OF = 10_000
MAX_LITERAL_CHARS = 1024
# The options every JSON grammar is compiled with (llguidance's JsonCompileOptions).
_COMPACT = {"whitespace_flexible": False}


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_NOT_SCHEMAS = ("const", "enum", "default", "examples", "required")
_REPEAT = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")


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


def _multiple_cost(value: object) -> int:
    """The significant digits of a multipleOf value as one integer (523457, 1.5 -> 15, 3600 -> 36)."""
    try:
        d = Decimal(str(value)).normalize()
    except (InvalidOperation, ValueError):  # an integer of thousands of digits
        return MAX_MULTIPLE_OF + 1
    if not d.is_finite():
        return 0
    digits = d.as_tuple().digits
    n = int("".join(map(str, digits)) or "0")
    while n and n % 10 == 0:
        n //= 10
    return n


def schema_bounds(schema: object, param: str) -> None:
    """Refuse (:class:`StructuredOutputError` naming ``param``) a schema whose grammar would cost
    the worker too much to compile or to mask with: ``multipleOf`` values adding up to over
    ``MAX_MULTIPLE_OF``, a literal (``const``, ``enum`` member, property name) or a counted
    repetition in a ``pattern`` over ``MAX_LITERAL_CHARS``, an integer bound the grammar's 64-bit
    clamp would widen. Iterative (the schema is at most 64 KiB and 24 levels deep by then, but a
    tool list may hold many)."""
    total = 0
    todo: list[object] = [schema]
    while todo:
        node = todo.pop()
        if isinstance(node, list):
            todo.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        for key, value in node.items():
            if key == "multipleOf" and isinstance(value, (int, float)) and not isinstance(value, bool):
                total += _multiple_cost(value)
                if total > MAX_MULTIPLE_OF:
                    raise StructuredOutputError(param, f"{param}: multipleOf {value} is too costly to enforce (the "
                                                       f"significant digits of a schema's multipleOf values may add "
                                                       f"up to {MAX_MULTIPLE_OF}: 1.5 counts 15, 3600 counts 36)")
            elif key in ("const", "enum"):
                for v in (value if key == "enum" and isinstance(value, list) else [value]):
                    n = len(v) if isinstance(v, str) else len(json.dumps(v, separators=(",", ":")))
                    if n > MAX_LITERAL_CHARS:
                        raise StructuredOutputError(param, f"{param}: a {key} value of {n} characters is too costly "
                                                           f"to enforce (at most {MAX_LITERAL_CHARS})")
            elif key == "pattern" and isinstance(value, str):
                _pattern_bounds(value, param)
            elif key in _LOWER_BOUNDS or key in _UPPER_BOUNDS:
                _bound_value(key, value, param)
            if key in _SCHEMA_MAPS and isinstance(value, dict):  # names to schemas: the names are no keywords
                for name, sub in value.items():
                    if key == "properties" and len(name) > MAX_LITERAL_CHARS:
                        raise StructuredOutputError(param, f"{param}: a property name of {len(name)} characters is "
                                                           f"too costly to enforce (at most {MAX_LITERAL_CHARS})")
                    if key == "patternProperties":
                        _pattern_bounds(name, param)
                    todo.append(sub)
            elif isinstance(value, (dict, list)) and key not in _NOT_SCHEMAS:
                todo.append(value)


# The grammar clamps an integer bound to 64 bits. Clamping a maximum down or a minimum up only
# narrows what it allows (a uint64 field's maximum is served), but a lower bound past the top (or
# an upper one past the bottom) widens it: 10**300 as a minimum let 9223372036854775807 through.
_INT64 = (-(1 << 63), (1 << 63) - 1)
_LOWER_BOUNDS = ("minimum", "exclusiveMinimum")
_UPPER_BOUNDS = ("maximum", "exclusiveMaximum")
# Visits the finiteness check may make (ref chains can make its search exponential); past them the
# schema is taken, and the engine ends a request whose grammar allows no token with an error.
MAX_FINITE_VISITS = 100_000


def _bound_value(key: str, value: object, param: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        return
    if (key in _LOWER_BOUNDS and value > _INT64[1]) or (key in _UPPER_BOUNDS and value < _INT64[0]):
        digits = str(value)  # not as a float: 10**400 has none
        shown = digits if len(digits) <= 24 else f"{digits[:12]}... ({len(digits)} digits)"
        raise StructuredOutputError(param, f"{param}: {key} {shown} is beyond what the grammar can enforce "
                                           f"(integers of 64 bits: {_INT64[0]} to {_INT64[1]})")


def finite_value_check(schema: object, param: str) -> None:
    """Refuse (:class:`StructuredOutputError` naming ``param``) a schema no finite JSON value
    satisfies because of its references: ``{"$ref": "#"}``, two definitions referring to each
    other, an object that requires a property of its own type. Such a grammar compiles and then
    allows no token (or only an endless value), which would end an answer as invalid JSON.

    A node has a finite value when its ``$ref`` target, every ``allOf`` member, one ``anyOf`` /
    ``oneOf`` member, an object's required properties (``type`` "object") and an array's first
    ``minItems`` items (``type`` "array") do. A minimal value never holds a node inside the same
    node, so a node met again while it is being decided counts as having none on that path; only
    "has one" is remembered (a "has none" decided with something on the stack may be wrong
    elsewhere). Everything else (keywords, unresolvable references) counts as finite: the check
    only refuses what it proves, and gives up after :data:`MAX_FINITE_VISITS`."""
    visits = 0
    finite: set[int] = set()

    def resolve(ref: str) -> object:
        if ref == "#":
            return schema
        if not ref.startswith("#/"):
            return True  # not ours to follow (refused or decided by the grammar)
        node: object = schema
        for part in ref[2:].split("/"):
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return True
        return node

    def ends(node: object, stack: set[int]) -> bool:
        nonlocal visits
        if not isinstance(node, dict):
            return node is not False
        key = id(node)
        if key in finite:
            return True
        if key in stack:
            return False
        visits += 1
        if visits > MAX_FINITE_VISITS:
            raise _GiveUp
        stack.add(key)
        try:
            ok = _node_ends(node, lambda sub: ends(sub, stack), resolve)
        finally:
            stack.discard(key)
        if ok:
            finite.add(key)
        return ok

    try:
        if not ends(schema, set()):
            raise StructuredOutputError(param, f"{param}: no finite JSON value satisfies the schema: its references "
                                               "go round a cycle that every value must follow again (a $ref to "
                                               "itself, or a required property of its own type)")
    except _GiveUp:
        return
    except RecursionError:  # a reference chain deeper than the stack: the engine's own end holds
        return


class _GiveUp(Exception):
    pass


def _node_ends(node: dict[str, Any], ends: Callable[[object], bool], resolve: Callable[[str], object]) -> bool:
    """Whether the object schema ``node`` has a finite value, given ``ends`` for its subschemas."""
    ref = node.get("$ref")
    if isinstance(ref, str) and not ends(resolve(ref)):
        return False
    all_of = node.get("allOf")
    if isinstance(all_of, list) and not all(ends(sub) for sub in all_of):
        return False
    for key in ("anyOf", "oneOf"):
        some = node.get(key)
        if isinstance(some, list) and some and not any(ends(sub) for sub in some):
            return False
    kind = node.get("type")
    if kind == "object":
        props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        # a required key not among the properties is taken by a pattern's schema (not followed
        # here: counted finite) or else by additionalProperties
        extra = True if node.get("patternProperties") else node.get("additionalProperties", True)
        for name in node.get("required") or []:
            if isinstance(name, str) and not ends(props.get(name, extra)):
                return False
    elif kind == "array":
        least = node.get("minItems", 0)
        if isinstance(least, int) and least > 0:
            prefix = node.get("prefixItems") if isinstance(node.get("prefixItems"), list) else []
            items = node.get("items", True)
            if not all(ends(sub) for sub in prefix[:least]):
                return False
            if least > len(prefix) and not ends(items if not isinstance(items, list) else True):
                return False
    return True


def _pattern_bounds(pattern: str, param: str) -> None:
    if len(pattern) > MAX_LITERAL_CHARS:
        raise StructuredOutputError(param, f"{param}: a pattern of {len(pattern)} characters is too costly to "
                                           f"enforce (at most {MAX_LITERAL_CHARS})")
    for m in _REPEAT.finditer(pattern):
        n = max(int(m.group(1)), int(m.group(2) or 0))
        if n > MAX_LITERAL_CHARS:
            raise StructuredOutputError(param, f"{param}: the pattern's repetition {m.group(0)} is too costly to "
                                               f"enforce (counts of at most {MAX_LITERAL_CHARS})")


def json_grammar(schema: dict[str, Any] | None, strict: bool, param: str) -> str:
    """The grammar of JSON values matching ``schema`` (None: any JSON object); raises
    :class:`StructuredOutputError` when it cannot be compiled or is over the bounds
    (:func:`schema_bounds`). Runs llguidance's check in this thread: the agent calls it through
    :class:`GrammarBuilder`, which runs it in a child process."""
    import llguidance

    if schema is not None:
        schema_bounds(schema, param)
        finite_value_check(schema, param)

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


def closed_objects(schema: object, in_all_of: bool = False) -> object:
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

    for t in tools:
        schema_bounds(t.get("parameters") or {}, "tools")
        finite_value_check(t.get("parameters") or {}, "tools")
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


class CheckFailed(Exception):
    """The check's child process ran over its time, or died (over its memory)."""


class _CheckProcess:
    """One child process running :mod:`agent.http.grammar_check`: a JSON line in, a JSON line out."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    @classmethod
    async def start(cls, memory_bytes: int) -> _CheckProcess:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "agent.http.grammar_check", str(memory_bytes),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
            env=env, limit=16 << 20)
        return cls(proc)

    async def ask(self, job: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(job, separators=(",", ":")).encode() + b"\n")
        await self.proc.stdin.drain()
        line = await self.proc.stdout.readline()
        if not line:
            raise CheckFailed("the check's process died")
        return json.loads(line)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()

    def cpu_seconds(self) -> float:
        """User and system time the child has spent (0 where /proc cannot tell)."""
        try:
            with open(f"/proc/{self.proc.pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            return 0.0


class GrammarBuilder:
    """Grammars for request formats, checked in child processes and kept by schema.

    ``checks`` and ``check_seconds`` count the schemas actually checked (cache misses);
    ``check_kills`` the checks stopped for time, memory or their request's end."""

    def __init__(self, entries: int = CACHE_ENTRIES, timeout_s: float = CHECK_TIMEOUT_S,
                 processes: int = CHECK_PROCESSES, memory_bytes: int = CHECK_MEMORY_BYTES) -> None:
        self._cache: OrderedDict[tuple[object, ...], str | StructuredOutputError] = OrderedDict()
        self._entries = entries
        self._timeout_s = timeout_s
        self._processes = processes
        self._memory_bytes = memory_bytes
        self._lock = threading.Lock()
        self._idle: list[_CheckProcess] = []
        self._reaping: set[asyncio.Task[Any]] = set()  # waits on killed children (no zombies)
        self._slots: asyncio.Semaphore | None = None
        self.checks = 0
        self.check_seconds = 0.0
        self.check_kills = 0

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
        return await self._cached(key, {"op": "json", "schema": schema, "strict": strict, "param": param}, param)

    async def _cached(self, key: tuple[object, ...], job: dict[str, Any], param: str) -> str:
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
        if hit is None:
            hit, keep = await self._check(job, param)
            if keep:
                with self._lock:
                    self._cache[key] = hit
                    while len(self._cache) > self._entries:
                        self._cache.popitem(last=False)
        if isinstance(hit, StructuredOutputError):
            raise hit
        return hit

    async def _check(self, job: dict[str, Any], param: str) -> tuple[str | StructuredOutputError, bool]:
        """(grammar or refusal, whether to keep it): the job in an idle child, within the bounds.
        A child that runs over its time, dies, or whose request is cancelled is killed; a
        timeout is kept only when the child was busy computing it (not starved by the machine's load)."""
        if self._slots is None:
            self._slots = asyncio.Semaphore(self._processes)
        async with self._slots:
            proc = self._idle.pop() if self._idle else None
            t0 = time.perf_counter()
            done = False
            try:
                if proc is None or proc.proc.returncode is not None:
                    proc = await _CheckProcess.start(self._memory_bytes)
                cpu0 = proc.cpu_seconds()
                try:
                    answer = await asyncio.wait_for(proc.ask(job), self._timeout_s)
                except asyncio.TimeoutError:
                    busy = proc.cpu_seconds() - cpu0 >= self._timeout_s / 2
                    return StructuredOutputError(param, f"{param}: the schema took over {self._timeout_s:g} s to "
                                                        "check; simplify it"), busy
                except (CheckFailed, OSError, ValueError):
                    return StructuredOutputError(param, f"{param}: the schema needs over "
                                                        f"{self._memory_bytes >> 20} MiB to check; simplify it"), True
                done = True
            finally:
                with self._lock:
                    self.checks += 1
                    self.check_seconds += time.perf_counter() - t0
                    if not done:
                        self.check_kills += 1
                if proc is not None:
                    if done:
                        self._idle.append(proc)
                    else:
                        self._kill(proc)
        if "error" in answer:
            return StructuredOutputError(answer["param"], answer["error"]), True
        return answer["grammar"], True

    async def _tool_grammar(self, call: ForcedCall) -> str:
        """:func:`tool_call_grammar`, in a child and kept like the schemas."""
        strict = call.strict
        key = ("tools:" + call.fmt.name, json.dumps(call.tools, separators=(",", ":")), strict, call.parallel)
        job = {"op": "tools", "fmt": [call.fmt.name, call.fmt.native], "tools": call.tools,
               "parallel": call.parallel, "strict": strict}
        return await self._cached(key, job, "tools")

    def _kill(self, proc: _CheckProcess) -> None:
        proc.kill()
        task = asyncio.ensure_future(proc.proc.wait())
        self._reaping.add(task)
        task.add_done_callback(self._reaping.discard)

    def close(self) -> None:
        """Kill the idle children (those at work are killed by their checks' end)."""
        while self._idle:
            self._idle.pop().kill()

    async def aclose(self) -> None:
        """:meth:`close`, then wait for every child killed so far to be gone."""
        while self._idle:
            self._kill(self._idle.pop())
        if self._reaping:
            await asyncio.gather(*self._reaping, return_exceptions=True)
