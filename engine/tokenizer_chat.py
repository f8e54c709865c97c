"""Chat templates rendered in a bounded Jinja sandbox.

A chat template comes with the model folder, so it is code we did not write. It renders in
jinja2's ``ImmutableSandboxedEnvironment`` (no attribute escapes, no mutation of inputs),
with the same options transformers uses (``trim_blocks``, ``lstrip_blocks``, loop controls,
``raise_exception``, ``strftime_now``, a ``tojson`` that does not HTML-escape), so prompts
match ``AutoTokenizer.apply_chat_template`` byte for byte.

The sandbox alone bounds neither time nor memory, so rendering also:

- refuses templates, messages and outputs past :class:`ChatTemplateLimits`;
- counts interpreter steps and checks a deadline while the template runs (nested loops
  that print nothing still stop);
- after every template line, checks the size of the template's variables, so doubling a
  string in a loop stops at twice the output limit instead of exhausting memory;
- checks operators (``*``, ``**``, ``%``, ``+``), calls, attribute reads and the
  amplifying filters *before* they build a big value.

Every failure is a :class:`ChatTemplateError`.
"""

from __future__ import annotations

import json
import re
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.sandbox import ImmutableSandboxedEnvironment

_TEMPLATE_FILE = "<chat_template>"
# A printf or str.format width/precision of 7+ digits: a single call could allocate GBs.
_BIG_PRINTF = re.compile(r"%[-+ #0]*(\*|\d{7,}|\d*\.(\*|\d{7,}))")
_BIG_FORMAT = re.compile(r"\{[^{}]*:[^{}]*\d{7,}")


class ChatTemplateError(ValueError):
    """The chat template or its inputs are invalid, too large, or the template failed."""


@dataclass(frozen=True)
class ChatTemplateLimits:
    """Bounds on one render. Defaults fit real templates (a few KB, ~100 steps a message)."""

    max_template_chars: int = 256 * 1024
    max_messages: int = 4096
    max_input_chars: int = 4 * 1024 * 1024  # all strings in messages and extra variables
    max_depth: int = 16  # nesting of dicts/lists in the inputs
    max_output_chars: int = 8 * 1024 * 1024
    max_steps: int = 2_000_000  # traced interpreter events
    timeout_s: float = 2.0


class _Exhausted(BaseException):
    """Raised from the tracer. BaseException so no ``except Exception`` in Jinja swallows it."""


def _size(value: Any) -> int:
    return len(value) if isinstance(value, (str, bytes, list, tuple, dict)) else 0


class _BoundedCodeGenerator(CodeGenerator):
    """Compiles ``a ~ b`` to a call the environment bounds (Jinja joins it inline otherwise)."""

    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        self.write("environment.bounded_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    code_generator_class = _BoundedCodeGenerator
    # Intercepted operators are also kept out of compile-time constant folding.
    intercepted_binops = frozenset(["*", "**", "%", "+"])

    def __init__(self, limits: ChatTemplateLimits) -> None:
        super().__init__(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[jinja2.ext.loopcontrols],
            autoescape=False,
        )
        self.limits = limits
        self.filters["tojson"] = self._tojson
        self.filters["center"] = self._center
        self.filters["indent"] = self._guard_filter(self.filters["indent"], self._check_indent)
        self.filters["format"] = self._guard_filter(self.filters["format"], self._check_format)
        self.filters["replace"] = self._guard_filter(self.filters["replace"], self._check_replace)
        self.filters["batch"] = self._guard_filter(self.filters["batch"], self._check_batch)
        # lipsum builds text in proportion to its argument and no template needs it.
        self.globals.pop("lipsum", None)
        self.globals["raise_exception"] = _raise_exception
        self.globals["strftime_now"] = self._strftime_now

    # -- size checks ---------------------------------------------------------------------

    def _refuse(self, what: str) -> ChatTemplateError:
        return ChatTemplateError(f"chat template: {what} exceeds the output bound")

    def check_value(self, value: Any) -> Any:
        if _size(value) > self.limits.max_output_chars:
            raise self._refuse("a value")
        return value

    def _check_int(self, n: Any) -> None:
        if isinstance(n, int) and not isinstance(n, bool) and abs(n) > self.limits.max_output_chars:
            raise self._refuse(f"the number {n}")

    def bounded_concat(self, parts: Sequence[Any]) -> str:
        strs = [p if isinstance(p, str) else str(p) for p in parts]
        if sum(map(len, strs)) > self.limits.max_output_chars:
            raise self._refuse("a concatenation")
        return "".join(strs)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        limit = self.limits.max_output_chars
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if _size(seq) and isinstance(n, int) and _size(seq) * max(n, 0) > limit:
                    raise self._refuse("a repetition")
        elif operator == "**":
            if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 4096:
                raise ChatTemplateError("chat template: integer power too large")
        elif operator == "%":
            if isinstance(left, str) and _BIG_PRINTF.search(left):
                raise self._refuse("a format width")
        elif operator == "+":
            if _size(left) + _size(right) > limit:
                raise self._refuse("a sum")
        return self.check_value(super().call_binop(context, operator, left, right))

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        for arg in (*args, *kwargs.values()):
            __self._check_int(arg)
            __self.check_value(arg)
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, str):
            __self._check_str_method(owner, getattr(__obj, "__name__", ""), args)
        return __self.check_value(super().call(__context, __obj, *args, **kwargs))

    def _check_str_method(self, s: str, name: str, args: tuple[Any, ...]) -> None:
        limit = self.limits.max_output_chars
        if name == "expandtabs":
            tab = args[0] if args and isinstance(args[0], int) else 8
            if s.count("\t") * max(tab, 0) + len(s) > limit:
                raise self._refuse("expandtabs")
        if name == "replace" and len(args) >= 2:
            self._check_replace(s, args[0], args[1])

    def wrap_str_format(self, value: Any) -> Any:
        # str.format is wrapped when looked up; its width digits are checked then.
        wrapped = super().wrap_str_format(value)
        if wrapped is not None and _BIG_FORMAT.search(value.__self__):
            raise self._refuse("a format width")
        return wrapped

    def getattr(self, obj: Any, attribute: str) -> Any:
        return self.check_value(super().getattr(obj, attribute))

    def getitem(self, obj: Any, argument: Any) -> Any:
        return self.check_value(super().getitem(obj, argument))

    # -- filters and globals -------------------------------------------------------------

    def _guard_filter(self, func: Callable[..., Any], check: Callable[..., None]) -> Callable:
        def guarded(*args: Any, **kwargs: Any) -> Any:
            # Context-taking filters get it first; checks see only the template's arguments.
            user_args = args[1:] if getattr(func, "jinja_pass_arg", None) else args
            check(*user_args, **kwargs)
            return self.check_value(func(*args, **kwargs))

        if getattr(func, "jinja_pass_arg", None) is not None:
            guarded.jinja_pass_arg = func.jinja_pass_arg  # type: ignore[attr-defined]
        return guarded

    def _check_indent(self, s: Any, width: Any = 4, *_a: Any, **_k: Any) -> None:
        w = len(width) if isinstance(width, str) else width
        if isinstance(w, int) and (str(s).count("\n") + 1) * abs(w) > self.limits.max_output_chars:
            raise self._refuse("indent")

    def _check_format(self, value: Any, *_a: Any, **_k: Any) -> None:
        if isinstance(value, str) and _BIG_PRINTF.search(value):
            raise self._refuse("a format width")

    def _check_replace(self, s: Any, old: Any = "", new: Any = "", *_a: Any, **_k: Any) -> None:
        s, old, new = str(s), str(old), str(new)
        hits = len(s) + 1 if not old else s.count(old)
        if len(s) + hits * max(len(new) - len(old), 0) > self.limits.max_output_chars:
            raise self._refuse("replace")

    def _check_batch(self, value: Any, linecount: Any = 1, *_a: Any, **_k: Any) -> None:
        self._check_int(linecount)

    def _center(self, value: Any, width: int = 80) -> str:
        self._check_int(width)
        return str(value).center(width)

    def _tojson(
        self,
        value: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: tuple[str, str] | None = None,
        sort_keys: bool = False,
    ) -> str:
        if indent is not None and (not isinstance(indent, int) or not 0 <= indent <= 64):
            raise ChatTemplateError(f"chat template: tojson indent must be 0..64, got {indent!r}")
        try:
            out = json.dumps(
                value,
                ensure_ascii=ensure_ascii,
                indent=indent,
                separators=separators,
                sort_keys=sort_keys,
            )
        except (TypeError, ValueError) as e:
            raise ChatTemplateError(f"chat template: tojson failed: {e}") from None
        return self.check_value(out)

    def _strftime_now(self, fmt: str) -> str:
        if not isinstance(fmt, str) or len(fmt) > 256:
            raise ChatTemplateError("chat template: strftime_now needs a short format string")
        return datetime.now().strftime(fmt)


def _raise_exception(message: Any) -> None:
    raise ChatTemplateError(f"chat template refused the conversation: {message}")


def check_inputs(
    messages: Any, extra: Mapping[str, Any], limits: ChatTemplateLimits
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Validate and copy ``messages`` (a list of mappings with a string ``role``) and ``extra``.

    Values must be JSON-like (str, int, float, bool, None, lists, string-keyed mappings),
    within the count, depth and total-size bounds. Returns plain copies so the template
    never sees caller objects.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ChatTemplateError("messages must be a list of {role, content} objects")
    if not messages:
        raise ChatTemplateError("messages must hold at least one message")
    if len(messages) > limits.max_messages:
        raise ChatTemplateError(
            f"too many messages: {len(messages)} (at most {limits.max_messages})"
        )
    budget = [limits.max_input_chars]

    def plain(value: Any, depth: int, where: str) -> Any:
        if depth > limits.max_depth:
            raise ChatTemplateError(f"{where}: nested deeper than {limits.max_depth}")
        if value is None or isinstance(value, (bool, int, float)):
            return value
        if isinstance(value, str):
            budget[0] -= len(value)
            if budget[0] < 0:
                raise ChatTemplateError(
                    f"messages are too large (more than {limits.max_input_chars} characters)"
                )
            return value
        if isinstance(value, Mapping):
            out = {}
            for k, v in value.items():
                if not isinstance(k, str):
                    raise ChatTemplateError(f"{where}: keys must be strings")
                out[plain(k, depth + 1, where)] = plain(v, depth + 1, f"{where}.{k}")
            return out
        if isinstance(value, (list, tuple)):
            budget[0] -= len(value)
            if budget[0] < 0:
                raise ChatTemplateError("messages are too large")
            return [plain(v, depth + 1, f"{where}[{i}]") for i, v in enumerate(value)]
        raise ChatTemplateError(f"{where}: unsupported value of type {type(value).__name__}")

    copied = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise ChatTemplateError(f"messages[{i}] must be an object with a string role")
        copied.append(plain(message, 1, f"messages[{i}]"))
    for key in extra:
        if not isinstance(key, str) or not key.isidentifier():
            raise ChatTemplateError(f"template variable name {key!r} is not an identifier")
    extra_copy = plain(dict(extra), 0, "template variables")
    return copied, extra_copy


class ChatTemplate:
    """A compiled chat template. :meth:`render` keeps its state on the call, so threads may
    share one instance (the step tracer is per thread)."""

    def __init__(self, source: str, limits: ChatTemplateLimits | None = None) -> None:
        self.limits = limits or ChatTemplateLimits()
        if not isinstance(source, str):
            raise ChatTemplateError("chat template must be a string")
        if len(source) > self.limits.max_template_chars:
            raise ChatTemplateError(
                f"chat template is {len(source)} characters "
                f"(at most {self.limits.max_template_chars})"
            )
        self._env = _BoundedSandbox(self.limits)
        try:
            code = self._env.compile(source, filename=_TEMPLATE_FILE)
            self._template = self._env.template_class.from_code(
                self._env, code, self._env.make_globals(None)
            )
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(f"chat template is invalid: {e.message} (line {e.lineno})")
        except (ChatTemplateError, MemoryError, RecursionError) as e:
            raise ChatTemplateError(f"chat template cannot be compiled: {e}") from None

    def render(self, messages: Sequence[Mapping[str, Any]], **variables: Any) -> str:
        """Render with ``messages`` and template ``variables`` (special tokens, flags, tools)."""
        msgs, extra = check_inputs(messages, variables, self.limits)
        limits = self.limits
        steps = 0
        deadline = time.monotonic() + limits.timeout_s

        def tracer(frame: Any, event: str, _arg: Any) -> Any:
            nonlocal steps
            steps += 1
            if steps > limits.max_steps:
                raise _Exhausted(f"more than {limits.max_steps} steps")
            if steps % 512 == 0 and time.monotonic() > deadline:
                raise _Exhausted(f"more than {limits.timeout_s} s")
            if event == "line" and frame.f_code.co_filename == _TEMPLATE_FILE:
                for value in frame.f_locals.values():
                    if _size(value) > limits.max_output_chars:
                        raise _Exhausted("a variable past the output bound")
            return tracer

        pieces: list[str] = []
        total = 0
        previous = sys.gettrace()
        sys.settrace(tracer)
        try:
            for piece in self._template.generate(messages=msgs, **extra):
                total += len(piece)
                if total > limits.max_output_chars:
                    raise ChatTemplateError(
                        f"chat template output exceeds {limits.max_output_chars} characters"
                    )
                pieces.append(piece)
        except _Exhausted as e:
            raise ChatTemplateError(f"chat template stopped: {e}") from None
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template failed: {e}") from None
        except (ArithmeticError, LookupError, TypeError, ValueError, AttributeError) as e:
            raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from None
        except (MemoryError, RecursionError) as e:
            raise ChatTemplateError(f"chat template exhausted resources: {type(e).__name__}")
        finally:
            sys.settrace(previous)
        return "".join(pieces)
