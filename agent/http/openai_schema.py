"""Request bodies of the OpenAI-compatible API, with a bound on every field.

Validation errors become 400s in OpenAI's error shape with ``param`` naming the field
(:func:`first_error`). Bounds that depend on the model (prompt plus ``max_tokens`` against the
context length) are checked after tokenization, in ``openai_api``.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, StringConstraints, ValidationError, ValidationInfo, field_validator,
                      model_validator)

from engine.sampling import MAX_LOGPROBS, MAX_TOKENS_LIMIT, MAX_TOP_K, SEED_MAX

MAX_N = 8
MAX_STOP = 8
MAX_STOP_CHARS = 256
MAX_MESSAGES = 1024
MAX_MESSAGE_CHARS = 1_000_000
MAX_CONTENT_PARTS = 64
MAX_PROMPT_CHARS = 4_000_000
MAX_PROMPT_TOKENS = 1 << 20
MAX_JSON_DEPTH = 32
MAX_SCHEMA_BYTES = 64 << 10
MAX_SCHEMA_DEPTH = 24  # dicts and lists: a dozen nested objects (each is "properties" then the object)
MAX_SCHEMA_DESCRIPTION = 4096
MAX_TOOLS = 128
MAX_TOOL_CALLS = 64

ModelName = Annotated[str, StringConstraints(min_length=1, max_length=128)]
StopString = Annotated[str, StringConstraints(min_length=1, max_length=MAX_STOP_CHARS)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class StreamOptions(_Body):
    include_usage: bool = False


def _bounded_schema(v: dict[str, Any], what: str) -> dict[str, Any]:
    """A schema within the size and depth bounds (``what`` names it in the error)."""
    if not json_depth_ok(v, MAX_SCHEMA_DEPTH):
        raise ValueError(f"the {what} nests deeper than {MAX_SCHEMA_DEPTH} levels")
    if len(json.dumps(v, separators=(",", ":"))) > MAX_SCHEMA_BYTES:
        raise ValueError(f"the {what} is over {MAX_SCHEMA_BYTES} bytes as JSON")
    return v


class JsonSchemaFormat(_Body):
    """``response_format.json_schema``: the schema is bounded in size and depth here; whether
    it compiles is decided by agent/http/structured.py (a 400 naming ``response_format``)."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    name: Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = Field(None, max_length=MAX_SCHEMA_DESCRIPTION)
    json_schema: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = False

    @field_validator("json_schema")
    @classmethod
    def _bound_schema(cls, v: dict[str, Any]) -> dict[str, Any]:
        return _bounded_schema(v, "schema")


class ResponseFormat(_Body):
    """``text`` (free), ``json_object`` (any JSON object) or ``json_schema`` (that schema)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> "ResponseFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("json_schema: type json_schema needs a json_schema object")
        if self.type != "json_schema" and self.json_schema is not None:
            raise ValueError(f"json_schema: only for type json_schema, not {self.type}")
        return self

    @property
    def constrained(self) -> bool:
        return self.type != "text"


class _Sampling(_Body):
    """Fields shared by both endpoints."""

    model: ModelName
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, le=MAX_TOP_K)  # -1 and 0 both mean off (vLLM uses -1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, le=SEED_MAX)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: StopString | list[StopString] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = Field(None, max_length=0)
    user: str | None = Field(None, max_length=256)
    response_format: ResponseFormat | None = None

    @field_validator("stop")
    @classmethod
    def _bound_stop(cls, v: Any) -> Any:
        if isinstance(v, list) and len(v) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalties(cls, v: float) -> float:
        if v != 0.0:
            raise ValueError("penalties are not supported; send 0 or leave it out")
        return v

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, v: Any, info: ValidationInfo) -> Any:
        if v is not None and not info.data.get("stream", False):
            raise ValueError("only allowed when stream is true")
        return v

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(_Sampling):
    prompt: Annotated[str, StringConstraints(max_length=MAX_PROMPT_CHARS)] | list[Any]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = Field(None, max_length=0)

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: Any) -> str | list[int]:
        """A string or a list of token ids; a batch of one is unwrapped, larger batches refused."""
        if isinstance(v, str):
            return v
        if len(v) == 1 and isinstance(v[0], (str, list)):
            return cls._one_prompt(v[0])
        if not v:
            raise ValueError("the prompt is empty")
        if len(v) > MAX_PROMPT_TOKENS:
            raise ValueError(f"at most {MAX_PROMPT_TOKENS} prompt tokens")
        if all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < (1 << 31) for t in v):
            return v
        if all(isinstance(t, (str, list)) for t in v):
            raise ValueError("send one prompt per request (use n for several completions)")
        raise ValueError("must be a string or a list of token ids (integers >= 0)")

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("echo is not supported")
        return v


class TextPart(_Body):
    type: Literal["text"]
    text: Annotated[str, StringConstraints(max_length=MAX_MESSAGE_CHARS)]


ToolName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]


class FunctionDef(_Body):
    name: ToolName
    description: str | None = Field(None, max_length=MAX_SCHEMA_DESCRIPTION)
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = False

    @field_validator("parameters")
    @classmethod
    def _bound_parameters(cls, v: dict[str, Any]) -> dict[str, Any]:
        return _bounded_schema(v, "parameters schema")


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Body):
    name: ToolName


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: FunctionName


class CalledFunction(_Body):
    name: ToolName
    arguments: Annotated[str, StringConstraints(max_length=MAX_MESSAGE_CHARS)]


class ToolCall(_Body):
    id: Annotated[str, StringConstraints(min_length=1, max_length=256)]
    type: Literal["function"]
    function: CalledFunction


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[str, StringConstraints(max_length=MAX_MESSAGE_CHARS)] | list[TextPart] | None = None
    name: str | None = Field(None, max_length=64)
    tool_call_id: str | None = Field(None, min_length=1, max_length=256)  # the call a tool message answers
    tool_calls: list[ToolCall] | None = Field(None, max_length=MAX_TOOL_CALLS)  # an assistant's calls

    @model_validator(mode="after")
    def _tool_fields_by_role(self) -> "ChatMessage":
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("tool_call_id: a tool message must name the call it answers")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("tool_calls: only assistant messages carry tool calls")
        return self

    @field_validator("content")
    @classmethod
    def _bound_parts(cls, v: Any) -> Any:
        if isinstance(v, list) and len(v) > MAX_CONTENT_PARTS:
            raise ValueError(f"at most {MAX_CONTENT_PARTS} content parts")
        return v

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)

    def template_view(self) -> dict[str, Any]:
        """The message as chat templates see it (transformers' keys; unset ones left out)."""
        view = {"role": self.role, "content": self.text()}
        if self.name:
            view["name"] = self.name
        if self.tool_call_id is not None:
            view["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            view["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        return view


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = Field(None, min_length=1, max_length=MAX_TOOLS)  # OpenAI refuses [] too
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _tools_consistent(self) -> "ChatCompletionRequest":
        names = [t.function.name for t in self.tools or ()]
        if len(set(names)) != len(names):
            raise ValueError("tools: two tools share a name")
        choice = self.tool_choice
        if choice not in (None, "none", "auto") and not names:
            raise ValueError("tool_choice: needs tools to choose from")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice: no tool named {choice.function.name!r}")
        if self.forces_call and self.response_format is not None and self.response_format.constrained:
            raise ValueError("response_format: cannot be combined with a tool_choice that forces a call")
        return self

    @property
    def uses_tools(self) -> bool:
        """Tools are offered: given, and ``tool_choice`` is not ``none``."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def forces_call(self) -> bool:
        return self.uses_tools and (self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice))

    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def logprobs_count(self) -> int | None:
        if not self.logprobs:
            return None
        return self.top_logprobs or 0


_BLAMED = re.compile(r"([a-z_]+): ")


def first_error(err: ValidationError) -> tuple[str, str]:
    """(param, message) of the first validation error, in words a client can act on."""
    e = err.errors()[0]
    loc = [str(p) for p in e["loc"] if not str(p).startswith(("function-", "constrained-"))]
    # Pydantic names union branches in loc ("str", "list[...]"); they mean nothing to a client.
    loc = [p for p in loc if not (p in ("str", "int", "float", "bool", "list") or p.startswith(("list[", "dict[", "tagged-union")))]
    param = ".".join(loc) if loc else None
    msg = e["msg"].removeprefix("Value error, ")
    # A check across fields says which one it blames first ("tool_choice: ..."): that field.
    named = _BLAMED.match(msg) if e["type"] == "value_error" else None
    if named:
        param = f"{param}.{named.group(1)}" if param else named.group(1)
        msg = msg[named.end():]
    if e["type"] == "extra_forbidden":
        msg = "unknown or unsupported parameter"
    return param or "body", f"{param}: {msg}" if param else msg


def json_depth_ok(obj: Any, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether parsed JSON nests at most ``limit`` levels (iterative: no recursion to exhaust)."""
    stack: list[tuple[Any, int]] = [(obj, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            if depth > limit:
                return False
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            if depth > limit:
                return False
            stack.extend((v, depth + 1) for v in node if isinstance(v, (dict, list)))
    return True
