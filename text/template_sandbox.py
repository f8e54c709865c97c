"""The bounded Jinja sandbox chat templates render in (see ``text/chat_template.py``).

jinja2's ``ImmutableSandboxedEnvironment`` stops attribute escapes and mutation of inputs
but bounds neither time nor memory. This environment adds two things:

- a per-render step budget with a deadline, charged by every loop iteration (each ``for``
  iterable is wrapped at compile time), every call (plus the length of container arguments,
  which the callee will likely walk), every filter and test, and ``range``. Jinja has no
  ``while``, so a template that never ends runs out of steps or time;
- size checks *before* anything can build a big value: ``~`` (compiled to a checked join),
  ``*``, ``**``, ``%``, ``+``, block captures and macro output (``concat``), printed values
  (``finalize``), calls with their widths and counts (``ljust``, ``replace``, ``format``,
  ``join``...), and the filters that grow text (``center``, ``indent``, ``join``, ``tojson``,
  ``string``...). No value past the output bound is ever created, so doubling a string in
  a loop stops at the bound instead of exhausting memory.

Everything raises ``ChatTemplateError``.
"""

from __future__ import annotations

import contextvars
import json
import re
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

import jinja2.ext
from jinja2 import nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.sandbox import ImmutableSandboxedEnvironment

# A printf or str.format width/precision of 7+ digits: a single call could allocate GBs.
_BIG_PRINTF = re.compile(r"%[-+ #0]*(\*|\d{7,}|\d*\.(\*|\d{7,}))")
_BIG_FORMAT = re.compile(r"\{[^{}]*:[^{}]*\d{7,}")
_CONTAINERS = (list, tuple, dict, range, str)
# Filters whose output is about the printed size of their input.
_PRINTING_FILTERS = ("string", "pprint", "xmlattr", "urlencode", "escape", "e", "forceescape",
                     "sum")
# Filters that walk an iterable: an iterator argument is listed first so its size is known.
_MATERIALIZING_FILTERS = frozenset({"join", "sum", "batch"})


class ChatTemplateError(ValueError):
    """The chat template or its inputs are invalid, too large, or the template failed."""


def shallow_size(value: Any) -> int:
    return len(value) if isinstance(value, (str, bytes, list, tuple, dict)) else 0


def printed_size(value: Any, cap: int, indent: int = 0) -> int:
    """About how many characters ``str(value)`` (or JSON with ``indent``) takes; stops
    counting once past ``cap``, so the walk costs at most about ``cap`` steps."""
    total = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, str):
            total += len(v)
        elif isinstance(v, (dict, list, tuple)):
            items = [*v.keys(), *v.values()] if isinstance(v, dict) else v
            total += len(items) * (2 + indent * (depth + 1))
            if total <= cap:
                stack.extend((item, depth + 1) for item in items)
        else:
            total += 24
        if total > cap:
            break
    return total


class RenderBudget:
    """Steps and time left to one render."""

    __slots__ = ("left", "deadline", "ticks", "max_steps", "timeout_s")

    def __init__(self, max_steps: int, timeout_s: float) -> None:
        self.left = self.max_steps = max_steps
        self.timeout_s = timeout_s
        self.deadline = time.monotonic() + timeout_s
        self.ticks = 0

    def charge(self, steps: int) -> None:
        self.left -= steps
        if self.left < 0:
            raise ChatTemplateError(f"chat template stopped: more than {self.max_steps} steps")
        self.ticks += 1
        if self.ticks & 15 == 0 and time.monotonic() > self.deadline:
            raise ChatTemplateError(f"chat template stopped: ran past {self.timeout_s} s")


class _BoundedCodeGenerator(CodeGenerator):
    """Compiles ``a ~ b`` to a checked join and wraps every ``for`` iterable in a counter."""

    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        self.write("environment.bounded_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")

    def visit_For(self, node: nodes.For, frame: Frame) -> None:
        node.iter = nodes.Call(
            nodes.EnvironmentAttribute("bounded_iter"), [node.iter], [], None, None,
            lineno=node.lineno,
        )
        super().visit_For(node, frame)


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """The environment of one compiled template; renders share it, each with its budget."""

    code_generator_class = _BoundedCodeGenerator
    # Intercepted operators are also kept out of compile-time constant folding.
    intercepted_binops = frozenset(["*", "**", "%", "+"])

    def __init__(self, max_output_chars: int) -> None:
        # The options transformers renders chat templates with, so prompts match its own.
        super().__init__(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[jinja2.ext.loopcontrols],
            autoescape=False,
            finalize=self._finalize,
        )
        self.limit = max_output_chars
        self.budget: contextvars.ContextVar[RenderBudget] = contextvars.ContextVar("budget")
        self.filters["tojson"] = self._tojson
        # lipsum builds text in proportion to its argument and no template needs it.
        self.globals.pop("lipsum", None)
        self.globals["range"] = self._range
        self.globals["raise_exception"] = _raise_exception
        self.globals["strftime_now"] = _strftime_now
        checks = {"center": self._check_width, "indent": self._check_indent,
                  "format": self._check_printf, "replace": self._check_replace,
                  "batch": self._check_width, "wordwrap": self._check_width,
                  "truncate": self._check_width, "join": self._check_join}
        for name in _PRINTING_FILTERS:
            checks.setdefault(name, self._check_printed)
        for name, func in list(self.filters.items()):
            self.filters[name] = self._counted(
                func, checks.get(name), name in _MATERIALIZING_FILTERS
            )
        for name, func in list(self.tests.items()):
            self.tests[name] = self._counted(func, None, False)

    # -- budget ----------------------------------------------------------------------------

    def charge(self, steps: int) -> None:
        budget = self.budget.get(None)
        if budget is None:
            # Compile-time constant folding: refusing keeps the expression for run time.
            raise ChatTemplateError("evaluated at render time only")
        budget.charge(steps)

    def bounded_iter(self, iterable: Any) -> Any:
        for item in iterable:
            self.charge(1)
            yield item

    def _range(self, *args: Any) -> range:
        for a in args:
            self._check_int(a)
        r = range(*args)
        self.charge(len(r))
        return r

    # -- size checks -----------------------------------------------------------------------

    def refuse(self, what: str) -> ChatTemplateError:
        return ChatTemplateError(f"chat template: {what} exceeds the output bound")

    def check_value(self, value: Any) -> Any:
        if shallow_size(value) > self.limit:
            raise self.refuse("a value")
        return value

    def _check_int(self, n: Any) -> None:
        if isinstance(n, int) and not isinstance(n, bool) and abs(n) > self.limit:
            raise self.refuse(f"the number {n}")

    def _check_printed(self, value: Any, *args: Any, **kwargs: Any) -> None:
        total = sum(printed_size(v, self.limit) for v in (value, *args, *kwargs.values()))
        if total > self.limit:
            raise self.refuse("printed text")

    def _finalize(self, value: Any) -> Any:
        if not isinstance(value, str) and printed_size(value, self.limit) > self.limit:
            raise self.refuse("a printed value")
        return value

    def bounded_concat(self, parts: tuple[Any, ...]) -> str:
        self._check_printed(*parts)
        return "".join(p if isinstance(p, str) else str(p) for p in parts)

    def concat(self, parts: Any) -> str:  # block captures and macro output
        parts = list(parts)
        if sum(map(len, parts)) > self.limit:
            raise self.refuse("captured output")
        return "".join(parts)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, _CONTAINERS) and isinstance(n, int):
                    if len(seq) * max(n, 0) > self.limit:
                        raise self.refuse("a repetition")
                    self.charge(len(seq) * max(n, 0))
            if isinstance(left, int) and isinstance(right, int):
                if left.bit_length() + right.bit_length() > 65536:
                    raise ChatTemplateError("chat template: integer product too large")
        elif operator == "**":
            if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 4096:
                raise ChatTemplateError("chat template: integer power too large")
        elif operator == "%":
            if isinstance(left, str):
                self._check_printf(left, right)
        elif operator == "+":
            if shallow_size(left) + shallow_size(right) > self.limit:
                raise self.refuse("a sum")
        return self.check_value(super().call_binop(context, operator, left, right))

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        values = (*args, *kwargs.values())
        __self.charge(1 + sum(len(v) for v in values if isinstance(v, (list, tuple, dict))))
        for v in values:
            __self._check_int(v)
            __self.check_value(v)
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, str):
            __self._check_str_method(owner, getattr(__obj, "__name__", ""), args)
        return __self.check_value(super().call(__context, __obj, *args, **kwargs))

    def _check_str_method(self, s: str, name: str, args: tuple[Any, ...]) -> None:
        if name == "expandtabs":
            tab = args[0] if args and isinstance(args[0], int) else 8
            if s.count("\t") * max(tab, 0) + len(s) > self.limit:
                raise self.refuse("expandtabs")
        elif name == "replace" and len(args) >= 2:
            self._check_replace(s, args[0], args[1])
        elif name == "join" and args:
            items = args[0]
            if not isinstance(items, (list, tuple, str)):
                raise ChatTemplateError("chat template: str.join needs a list here")
            if len(s) * len(items) + printed_size(items, self.limit) > self.limit:
                raise self.refuse("a join")

    def wrap_str_format(self, value: Any) -> Any:
        # str.format is wrapped when looked up; its widths and fields are checked then.
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None
        fmt = value.__self__
        if _BIG_FORMAT.search(fmt):
            raise self.refuse("a format width")

        def checked(*args: Any, **kwargs: Any) -> str:
            self._check_printf(fmt.replace("{", "%"), (*args, *kwargs.values()))
            return wrapped(*args, **kwargs)

        return checked

    def getattr(self, obj: Any, attribute: str) -> Any:
        return self.check_value(super().getattr(obj, attribute))

    def getitem(self, obj: Any, argument: Any) -> Any:
        return self.check_value(super().getitem(obj, argument))

    # -- filters ---------------------------------------------------------------------------

    def _counted(
        self, func: Callable[..., Any], check: Callable[..., None] | None, materialize: bool
    ) -> Callable:
        passes_arg = getattr(func, "jinja_pass_arg", None)

        def counted(*args: Any, **kwargs: Any) -> Any:
            # Context-taking filters get it first; checks see only the template's arguments.
            user_args = args[1:] if passes_arg is not None else args
            value = user_args[0] if user_args else None
            self.charge(1 + (len(value) if isinstance(value, (list, tuple, dict)) else 0))
            if materialize and user_args and not isinstance(value, _CONTAINERS):
                value = list(self.bounded_iter(value))
                skipped = len(args) - len(user_args)
                args = (*args[:skipped], value, *user_args[1:])
                user_args = args[skipped:]
            if check is not None:
                check(*user_args, **kwargs)
            return self.check_value(func(*args, **kwargs))

        if passes_arg is not None:
            counted.jinja_pass_arg = passes_arg  # type: ignore[attr-defined]
        return counted

    def _check_width(self, value: Any, width: Any = 80, *args: Any, **kwargs: Any) -> None:
        self._check_int(width)
        for v in (*args, *kwargs.values()):
            self._check_int(v)

    def _check_join(self, items: Any, d: Any = "", *_a: Any, **_k: Any) -> None:
        count = len(items) if isinstance(items, _CONTAINERS) else 0
        if printed_size(items, self.limit) + len(str(d)) * count > self.limit:
            raise self.refuse("a join")

    def _check_indent(self, s: Any, width: Any = 4, *_a: Any, **_k: Any) -> None:
        w = len(width) if isinstance(width, str) else width
        if isinstance(w, int) and (str(s).count("\n") + 1) * abs(w) + len(str(s)) > self.limit:
            raise self.refuse("indent")

    def _check_printf(self, fmt: Any, *args: Any, **kwargs: Any) -> None:
        if not isinstance(fmt, str):
            return
        if _BIG_PRINTF.search(fmt):
            raise self.refuse("a format width")
        # Each field prints at most the largest argument.
        largest = max((printed_size(v, self.limit) for v in (*args, *kwargs.values())),
                      default=0)
        if len(fmt) + fmt.count("%") * largest > self.limit:
            raise self.refuse("formatted text")

    def _check_replace(self, s: Any, old: Any = "", new: Any = "", *_a: Any, **_k: Any) -> None:
        s, old, new = str(s), str(old), str(new)
        hits = len(s) + 1 if not old else s.count(old)
        if len(s) + hits * max(len(new) - len(old), 0) > self.limit:
            raise self.refuse("replace")

    def _tojson(
        self,
        value: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: tuple[str, str] | None = None,
        sort_keys: bool = False,
    ) -> str:
        # transformers' tojson: no HTML escaping (unlike Jinja's), so prompts match.
        if indent is not None and (not isinstance(indent, int) or not 0 <= indent <= 64):
            raise ChatTemplateError(f"chat template: tojson indent must be 0..64, got {indent!r}")
        if printed_size(value, self.limit, indent or 0) > self.limit:
            raise self.refuse("tojson")
        try:
            return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                              separators=separators, sort_keys=sort_keys)
        except (TypeError, ValueError) as e:
            raise ChatTemplateError(f"chat template: tojson failed: {e}") from None


def _raise_exception(message: Any) -> None:
    raise ChatTemplateError(f"chat template refused the conversation: {message}")


def _strftime_now(fmt: str) -> str:
    if not isinstance(fmt, str) or len(fmt) > 256:
        raise ChatTemplateError("chat template: strftime_now needs a short format string")
    return datetime.now().strftime(fmt)
