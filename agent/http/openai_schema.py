"""Request bodies of the OpenAI-compatible API, with a bound on every field.

Types are strict (``max_tokens: true`` or ``"5"`` is not a number, ``"yes"`` not a boolean), and
validation errors become 400s in OpenAI's error shape with ``param`` naming the field, in words
a client can act on (:func:`first_error`). Fields OpenAI documents that carry no meaning here
(``metadata``, ``store``, ``service_tier``, ``reasoning_effort``, a message's ``refusal`` or
``annotations``...) are taken and ignored; those that would change the answer are refused
(docs/api.md lists both). Bounds that depend on the model (prompt plus ``max_tokens`` against the
context length) are checked after tokenization, in ``openai_api``.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, StringConstraints, ValidationError, ValidationInfo, field_validator,
                      model_validator)

from engine.sampling import (MAX_LOGIT_BIAS, MAX_LOGIT_BIAS_ENTRIES, MAX_LOGPROBS, MAX_PENALTY, MAX_REPETITION_PENALTY,
                             MAX_TOKENS_LIMIT, MAX_TOP_K, SEED_MAX)

MAX_N = 8
MAX_PROMPTS = 64  # a completion's list of prompts
MAX_CHOICES = 64  # prompts x n: the engine requests one HTTP request may start
MAX_STOP = 8
MAX_STOP_CHARS = 256
MAX_MESSAGES = 1024
MAX_MESSAGE_CHARS = 1_000_000
MAX_CONTENT_PARTS = 64
MAX_PROMPT_CHARS = 4_000_000
MAX_PROMPT_TOKENS = 1 << 20
# Prompt logprob entries in one answer (prompt tokens x n x (top N + 1)): ~15 MB of JSON. Each
# costs a client only its prompt's prefill but the agent a dict to build and serialize; 64
# prompts of 4,096 tokens at lm-eval's logprobs 1 are 524,288.
MAX_PROMPT_LOGPROB_ENTRIES = 1 << 19
# Streamed, the first chunk carries them and is built on the event loop (0.5 s at 2^19 on the
# CPU box): a quarter of the bound.
MAX_STREAMED_PROMPT_LOGPROB_ENTRIES = 1 << 17
MAX_JSON_DEPTH = 32
MAX_SCHEMA_BYTES = 64 << 10
MAX_SCHEMA_DEPTH = 24  # dicts and lists: a dozen nested objects (each is "properties" then the object)
MAX_SCHEMA_DESCRIPTION = 4096
MAX_TOOLS = 128
MAX_TOOL_CALLS = 64
MAX_METADATA = 16  # OpenAI's own bounds on ``metadata``: 16 pairs, keys 64 and values 512 characters
MAX_ANNOTATIONS = 256

ModelName = Annotated[str, StringConstraints(min_length=1, max_length=128)]
StopString = Annotated[str, StringConstraints(min_length=1, max_length=MAX_STOP_CHARS)]


class _Body(BaseModel):
    # strict: no coercion (true is not 1, "5" not 5, "false" not a boolean); a float field still takes 1.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


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

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, populate_by_name=True)

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
    presence_penalty: float = Field(0.0, ge=-MAX_PENALTY, le=MAX_PENALTY)
    frequency_penalty: float = Field(0.0, ge=-MAX_PENALTY, le=MAX_PENALTY)
    repetition_penalty: float = Field(1.0, gt=0.0, le=MAX_REPETITION_PENALTY)  # vLLM's; 1 = off
    min_tokens: int = Field(0, ge=0, le=MAX_TOKENS_LIMIT)  # vLLM's: no end before this many tokens
    # OpenAI's shape: token ids as strings → a bias in [-100, 100]
    logit_bias: dict[str, float] | None = Field(None, max_length=MAX_LOGIT_BIAS_ENTRIES)
    user: str | None = Field(None, max_length=256)
    response_format: ResponseFormat | None = None

    @field_validator("stop")
    @classmethod
    def _bound_stop(cls, v: Any) -> Any:
        if isinstance(v, list) and len(v) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias_by_token_id(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for k, b in (v or {}).items():
            if not (k.isascii() and k.isdigit() and len(k) <= 10):
                raise ValueError(f"keys are token ids (\"123\"), not {k[:32]!r}")
            if not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS:
                raise ValueError(f"the bias of token {k} must be in [{-MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
        return v

    def logit_bias_pairs(self) -> list[tuple[int, float]]:
        return [(int(k), float(b)) for k, b in (self.logit_bias or {}).items()]

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


PromptText = Annotated[str, StringConstraints(max_length=MAX_PROMPT_CHARS)]


def _is_token_ids(v: list[Any]) -> bool:
    return all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < (1 << 31) for t in v)


class CompletionRequest(_Sampling):
    prompt: PromptText | list[Any]
    # 0 only with echo: the prompt (and its logprobs) back, nothing generated (lm-eval's loglikelihood)
    max_tokens: int | None = Field(None, ge=0, le=MAX_TOKENS_LIMIT)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # vLLM's: the prompt's, beside the answer
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_N)  # the n answers are all returned: best_of = n

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, v: Any) -> str | list[int] | list[str | list[int]]:
        """A string, a list of token ids, or a list of either (a batch; one of one is unwrapped).
        The lengths are bounded here (texts in characters, ids in count, in all); the tokens of
        each against the model's context after tokenizing."""
        if isinstance(v, str):
            return v
        if not v:
            raise ValueError("the prompt is empty")
        if all(isinstance(p, str) for p in v) or all(isinstance(p, list) for p in v):
            if len(v) == 1:
                return cls._one(v[0])
            if len(v) > MAX_PROMPTS:
                raise ValueError(f"at most {MAX_PROMPTS} prompts in one request")
            batch = [cls._one(p) for p in v]
            if sum(len(p) for p in batch if isinstance(p, str)) > MAX_PROMPT_CHARS:
                raise ValueError(f"the prompts have more than {MAX_PROMPT_CHARS} characters together")
            if sum(len(p) for p in batch if isinstance(p, list)) > MAX_PROMPT_TOKENS:
                raise ValueError(f"the prompts have more than {MAX_PROMPT_TOKENS} tokens together")
            return batch
        if _is_token_ids(v):
            return cls._one(v)
        raise ValueError("must be a string, a list of token ids (integers >= 0), a list of strings "
                         "or a list of token id lists")

    @staticmethod
    def _one(p: Any) -> str | list[int]:
        if isinstance(p, str):
            if len(p) > MAX_PROMPT_CHARS:
                raise ValueError(f"a prompt has more than {MAX_PROMPT_CHARS} characters")
            return p
        if not p:
            raise ValueError("a prompt is empty")
        if len(p) > MAX_PROMPT_TOKENS:
            raise ValueError(f"at most {MAX_PROMPT_TOKENS} prompt tokens")
        if not _is_token_ids(p):
            raise ValueError("a list of token ids holds integers >= 0 only")
        return p

    @model_validator(mode="after")
    def _echo(self) -> "CompletionRequest":
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens: 0 is served with echo only (the prompt back, nothing generated)")
        return self

    def wants_prompt_logprobs(self) -> int | None:
        """The top N of the prompt's logprobs to compute: echo's ``logprobs``, else vLLM's field."""
        return self.logprobs if self.echo and self.logprobs is not None else self.prompt_logprobs

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> str | None:
        if v:
            raise ValueError("suffix is not supported (no insertion); send \"\" or leave it out")
        return v

    @model_validator(mode="after")
    def _best_of_is_n(self) -> "CompletionRequest":
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of: only best_of = n ({self.n}) is served (every candidate is returned, "
                             f"none is picked by likelihood); got {self.best_of}")
        return self

    @model_validator(mode="after")
    def _bound_choices(self) -> "CompletionRequest":
        if len(self.prompts()) * self.n > MAX_CHOICES:
            raise ValueError(f"n: {len(self.prompts())} prompts x n={self.n} is over {MAX_CHOICES} "
                             "completions in one request")
        return self

    @property
    def batched(self) -> bool:
        """The prompt is a list of several prompts."""
        return isinstance(self.prompt, list) and bool(self.prompt) and not isinstance(self.prompt[0], int)

    def prompts(self) -> list[str | list[int]]:
        """Every prompt, in order (one for a single prompt)."""
        return list(self.prompt) if self.batched else [self.prompt]  # type: ignore[list-item]


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
    # What the openai SDK's own message objects carry (``message.model_dump()`` sent back as history):
    refusal: str | None = Field(None, max_length=MAX_MESSAGE_CHARS)  # an assistant's refusal: what it said
    annotations: list[dict[str, Any]] | None = Field(None, max_length=MAX_ANNOTATIONS)  # citations: ignored
    audio: dict[str, Any] | None = None  # a reference to an earlier audio answer: none here
    function_call: CalledFunction | None = None  # the legacy form of one tool call

    @model_validator(mode="after")
    def _tool_fields_by_role(self) -> "ChatMessage":
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("tool_call_id: a tool message must name the call it answers")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("tool_calls: only assistant messages carry tool calls")
        if self.function_call is not None and self.role != "assistant":
            raise ValueError("function_call: only assistant messages carry a function call")
        if self.function_call is not None and self.tool_calls:
            raise ValueError("function_call: send the call in tool_calls or in function_call, not both")
        if self.refusal and self.role != "assistant":
            raise ValueError("refusal: only assistant messages carry a refusal")
        return self

    @field_validator("audio")
    @classmethod
    def _no_audio(cls, v: Any) -> Any:
        if v is not None:
            raise ValueError("audio is not supported (text only); send null or leave it out")
        return v

    @field_validator("content")
    @classmethod
    def _bound_parts(cls, v: Any) -> Any:
        if isinstance(v, list) and len(v) > MAX_CONTENT_PARTS:
            raise ValueError(f"at most {MAX_CONTENT_PARTS} content parts")
        return v

    def text(self) -> str:
        if self.content is None or self.content == [] or self.content == "":
            return self.refusal or ""  # a refused turn: the refusal is what the assistant said
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)

    def calls(self) -> list[ToolCall]:
        """The assistant's tool calls; a legacy ``function_call`` is one call."""
        if self.function_call is not None:
            return [ToolCall(id="call_0", type="function", function=self.function_call)]
        return list(self.tool_calls or ())

    def template_view(self) -> dict[str, Any]:
        """The message as chat templates see it (transformers' keys; unset ones left out)."""
        view = {"role": self.role, "content": self.text()}
        if self.name:
            view["name"] = self.name
        if self.tool_call_id is not None:
            view["tool_call_id"] = self.tool_call_id
        if calls := self.calls():
            view["tool_calls"] = [c.model_dump() for c in calls]
        return view


ServiceTier = Literal["auto", "default", "flex", "scale", "priority"]
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = Field(None, min_length=1, max_length=MAX_TOOLS)  # OpenAI refuses [] too
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # Taken and ignored: they change nothing in the answer (docs/api.md).
    metadata: dict[str, Annotated[str, StringConstraints(max_length=512)]] | None = Field(None, max_length=MAX_METADATA)
    store: bool | None = None
    service_tier: ServiceTier | None = None
    reasoning_effort: ReasoningEffort | None = None
    modalities: list[str] | None = Field(None, max_length=4)

    @field_validator("metadata")
    @classmethod
    def _bound_metadata_keys(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        if v and any(not 1 <= len(k) <= 64 for k in v):
            raise ValueError("keys are 1 to 64 characters")
        return v

    @field_validator("modalities")
    @classmethod
    def _text_only(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and v != ["text"]:
            other = next((m for m in v if m != "text"), None)
            raise ValueError(f"only text output is supported; {other!r} is not" if other else
                             'send ["text"] or leave it out')
        return v

    @model_validator(mode="after")
    def _tools_consistent(self) -> "ChatCompletionRequest":
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs: true")
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
        if self.logprobs and self.stream and self.uses_tools:
            # a streamed answer that offers tools holds text back until it knows whether a call
            # starts there, and its chunks carried no logprobs (served whole, or with tool_choice none)
            raise ValueError("logprobs: not streamed when tools are offered (ask without stream, or with "
                             "tool_choice none)")
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
    """(param, message) of the first validation error, in words a client can act on. Of a
    union's errors (one a branch), the one of the branch the value's type took: ``stop: [""]``
    is an empty string in a list, not "must be a string"."""
    errors = err.errors()
    e = errors[0]
    field = _where(e)[:1]
    # An object whose ``type`` we do not serve (an image part, a custom tool): its ``type`` is the
    # error, not the fields its kind lacks ("content.0.text: required" for an image_url part).
    kind = next((x for x in errors if x["type"] == "literal_error" and _where(x)[:1] == field
                 and _where(x)[-1:] == ["type"]), None)
    e = kind or next((x for x in errors if _where(x)[:1] == field and x["type"] not in _TYPE_MISMATCH), e)
    loc = _where(e)
    param = ".".join(loc) if loc else None
    msg = e["msg"].removeprefix("Value error, ")
    # A check across fields says which one it blames first ("tool_choice: ..."): that field.
    named = _BLAMED.match(msg) if e["type"] == "value_error" else None
    if named:
        param = f"{param}.{named.group(1)}" if param else named.group(1)
        msg = msg[named.end():]
    msg = _WORDS.get(e["type"], msg)
    # pydantic's phrasing -> ours: "Input should be a valid integer" -> "must be a valid integer".
    msg = msg.replace("Input should be", "must be").replace(" after validation", "")
    for what in ("List", "Dictionary", "String"):
        msg = msg.replace(f"{what} should have", "should have")
    if msg == "Field required":
        msg = "required"
    if param and msg.startswith(param + " "):  # "logit_bias is not supported": names it already
        return param, msg
    return param or "body", f"{param}: {msg}" if param else msg


def _where(e: Any) -> list[str]:
    """An error's location as a client names it: pydantic's names of union branches ("str",
    "list[...]", "literal[...]", one of this module's models) and validators left out."""
    return [p for p in map(str, e["loc"])
            if not (p in ("str", "int", "float", "bool", "list") or p.startswith(_BRANCH_TAGS) or _is_model_name(p))]


_BRANCH_TAGS = ("function-", "constrained-", "list[", "dict[", "literal[", "tagged-union")


def _is_model_name(name: str) -> bool:
    """A union branch that is one of this module's models (a client's own key may be CamelCase)."""
    obj = globals().get(name)
    return isinstance(obj, type) and issubclass(obj, BaseModel)


# A value of the wrong type for a union's branch: another branch's error says more.
_TYPE_MISMATCH = frozenset({"string_type", "list_type", "dict_type", "model_type", "model_attributes_type",
                            "int_type", "float_type", "bool_type", "literal_error", "is_instance_of"})


# Errors of types whose pydantic wording is not the client's (strict types: no coercion).
_WORDS = {
    "extra_forbidden": "unknown or unsupported parameter",
    "int_type": "must be an integer", "int_parsing": "must be an integer", "int_from_float": "must be an integer",
    "bool_type": "must be true or false (a JSON boolean)", "bool_parsing": "must be true or false (a JSON boolean)",
    "float_type": "must be a number", "float_parsing": "must be a number", "finite_number": "must be a finite number",
    "string_type": "must be a string", "string_unicode": "must be valid Unicode text (no lone surrogates)",
    "dict_type": "must be an object", "list_type": "must be an array",
    "model_type": "must be an object", "model_attributes_type": "must be an object",
}


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
