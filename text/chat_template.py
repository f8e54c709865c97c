"""Chat templates rendered in a bounded Jinja sandbox.

A chat template comes with the model folder, so it is code we did not write. It renders in
:class:`~text.template_sandbox.BoundedSandbox` (jinja2's immutable sandbox plus a step
budget, a deadline and size checks before any big value is built), with the options and
helpers transformers uses (``trim_blocks``, ``lstrip_blocks``, loop controls,
``raise_exception``, ``strftime_now``, a ``tojson`` that does not HTML-escape), so prompts
match ``AutoTokenizer.apply_chat_template`` byte for byte.

Inputs are checked and copied to plain data first (:func:`check_inputs`), and the output is
counted as it streams out. Every failure is a :class:`ChatTemplateError`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jinja2

from text.template_sandbox import BoundedSandbox, ChatTemplateError, RenderBudget

__all__ = ["ChatTemplate", "ChatTemplateError", "ChatTemplateLimits", "check_inputs"]

_TEMPLATE_FILE = "<chat_template>"


@dataclass(frozen=True)
class ChatTemplateLimits:
    """Bounds on one render. Defaults fit real templates (a few KB, tens of steps a message)."""

    max_template_chars: int = 256 * 1024
    max_messages: int = 4096
    max_input_chars: int = 4 * 1024 * 1024  # all strings in messages and extra variables
    max_depth: int = 16  # nesting of dicts/lists in the inputs
    max_output_chars: int = 8 * 1024 * 1024
    max_steps: int = 4_000_000  # loop iterations, calls, filters, range items
    timeout_s: float = 2.0


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
    """A compiled chat template. Each render has its own budget, so threads may share one."""

    def __init__(self, source: str, limits: ChatTemplateLimits | None = None) -> None:
        self.limits = limits or ChatTemplateLimits()
        if not isinstance(source, str):
            raise ChatTemplateError("chat template must be a string")
        if len(source) > self.limits.max_template_chars:
            raise ChatTemplateError(
                f"chat template is {len(source)} characters "
                f"(at most {self.limits.max_template_chars})"
            )
        self._env = BoundedSandbox(self.limits.max_output_chars)
        try:
            code = self._env.compile(source, filename=_TEMPLATE_FILE)
            self._template = self._env.template_class.from_code(
                self._env, code, self._env.make_globals(None)
            )
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(
                f"chat template is invalid: {e.message} (line {e.lineno})"
            ) from None
        except (MemoryError, RecursionError) as e:
            raise ChatTemplateError(f"chat template cannot be compiled: {e!r}") from None

    def render(self, messages: Sequence[Mapping[str, Any]], **variables: Any) -> str:
        """Render with ``messages`` and template ``variables`` (special tokens, flags, tools)."""
        msgs, extra = check_inputs(messages, variables, self.limits)
        limits = self.limits
        pieces: list[str] = []
        total = 0
        token = self._env.budget.set(RenderBudget(limits.max_steps, limits.timeout_s))
        try:
            for piece in self._template.generate(messages=msgs, **extra):
                total += len(piece)
                if total > limits.max_output_chars:
                    raise ChatTemplateError(
                        f"chat template output exceeds {limits.max_output_chars} characters"
                    )
                pieces.append(piece)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template failed: {e}") from None
        except (MemoryError, RecursionError) as e:
            raise ChatTemplateError(
                f"chat template exhausted resources: {type(e).__name__}"
            ) from None
        except Exception as e:  # anything else a template raises is its own failure
            raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from None
        finally:
            self._env.budget.reset(token)
        return "".join(pieces)
